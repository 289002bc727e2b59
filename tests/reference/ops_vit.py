"""ViT (src/models/vit.cpp) in float64 with autograd, built from octet's state_dict names.

pixels [B, C*H*W] -> P x P patches (channel, row, column inside a patch: a convolution's
weight layout) -> patch embedding -> [class token; patches] + positions -> pre-norm encoder
TransformerLayers without a mask (the functions ops_transformer.py checks TransformerLayer
against) -> the class token's final norm -> the classifier -> cross-entropy, mean over the
batch. Dropout is 0.

Op "vit": the loss, the logits and every parameter's gradient."""
import torch
import torch.nn.functional as F

from ops_transformer import _mha, _mlp, _norm
from registry import op


def vit_forward(p, pixels, labels, c):
    b = pixels.shape[0]
    s, ps, ch = c["image_size"], c["patch_size"], c.get("channels", 1)
    heads = c["num_heads"]
    args = {"heads": heads, "gqa_groups": heads, "kv_channels": c["hidden"] // heads,
            "norm": c.get("normalization", "layernorm"), "eps": c.get("layernorm_eps", 1e-6),
            "mask": "no_mask", "activation": c.get("activation", "gelu")}
    img = pixels.reshape(b, ch, s, s)
    patches = img.unfold(2, ps, ps).unfold(3, ps, ps)  # [B, C, S/P, S/P, P, P]
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, ch * ps * ps)
    x = F.linear(patches, p["vit.embeddings.patch_embeddings.weight"],
                 p["vit.embeddings.patch_embeddings.bias"])
    cls = p["vit.embeddings.cls_token"].reshape(1, 1, -1).expand(b, 1, x.shape[-1])
    x = torch.cat([cls, x], 1) + p["vit.embeddings.position_embeddings"].unsqueeze(0)
    for i in range(c["num_layers"]):
        prefix = "vit.encoder.layer.%d." % i
        attn, bias = _mha(p, prefix + "self_attention.", x, None, args, {})
        h = x + (attn if bias is None else attn + bias)
        x = h + _mlp(p, prefix + "layernorm_mlp.", h, args)
    cls_out = _norm(x[:, 0], p["vit.layernorm.weight"], p.get("vit.layernorm.bias"), args["norm"],
                    args["eps"])
    logits = F.linear(cls_out, p["classifier.weight"], p["classifier.bias"])
    return F.cross_entropy(logits, labels), logits


@op("vit")
def vit(t, args):
    params = {n: v.double().requires_grad_() for n, v in t.items()
              if n not in ("pixels", "labels")}
    loss, logits = vit_forward(params, t["pixels"].double(), t["labels"].long(), args["config"])
    loss.backward()
    out = {"loss": loss.reshape(1), "logits": logits}
    out.update({n + ".grad": p.grad.clone() for n, p in params.items()})
    return out

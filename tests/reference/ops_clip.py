"""CLIP (src/models/clip.cpp) in float64 with autograd, built from octet's state_dict names.

Vision: pixels [B, C*H*W] -> P x P patches -> patch embedding (no bias) -> [class token;
patches] + positions -> pre-LayerNorm -> pre-norm encoder layers without a mask -> the class
token's LayerNorm -> visual projection (no bias). Text: token + position embeddings -> causal
pre-norm layers -> the LayerNorm of each caption's last token (its [EOS], at length - 1) ->
text projection (no bias). Loss: unit features, logits = exp(min(logit_scale, ln 100)) x
caption . image, cross-entropy per caption over images and per image over captions, averaged.
Dropout is 0.

Op "clip": the loss, the unit image and text features, and every parameter's gradient."""
import math

import torch
import torch.nn.functional as F

from ops_transformer import _mha, _mlp, _norm
from registry import op


def _layers(p, prefix, x, count, heads, mask, c):
    hidden = x.shape[-1]
    args = {"heads": heads, "gqa_groups": heads, "kv_channels": hidden // heads,
            "norm": "layernorm", "eps": c.get("layernorm_eps", 1e-5), "mask": mask,
            "activation": c.get("activation", "gelu")}
    for i in range(count):
        name = prefix + "%d." % i
        attn, bias = _mha(p, name + "self_attention.", x, None, args, {})
        h = x + (attn if bias is None else attn + bias)
        x = h + _mlp(p, name + "layernorm_mlp.", h, args)
    return x


def vision_tokens(p, pixels, c):
    """The vision tower's tokens [B, 1 + patches, hidden] after its encoder layers."""
    eps = c.get("layernorm_eps", 1e-5)
    b = pixels.shape[0]
    s, ps, ch = c["image_size"], c["patch_size"], c.get("channels", 1)
    img = pixels.reshape(b, ch, s, s)
    patches = img.unfold(2, ps, ps).unfold(3, ps, ps)  # [B, C, S/P, S/P, P, P]
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, ch * ps * ps)
    x = F.linear(patches, p["vision_model.embeddings.patch_embedding.weight"])
    cls = p["vision_model.embeddings.class_embedding"].reshape(1, 1, -1).expand(b, 1, x.shape[-1])
    x = torch.cat([cls, x], 1) + p["vision_model.embeddings.position_embedding"].unsqueeze(0)
    x = _norm(x, p["vision_model.pre_layrnorm.weight"], p["vision_model.pre_layrnorm.bias"],
              "layernorm", eps)
    return _layers(p, "vision_model.encoder.layers.", x, c["vision_layers"], c["vision_heads"],
                   "no_mask", c)


def clip_forward(p, pixels, ids, lengths, c):
    eps = c.get("layernorm_eps", 1e-5)
    b = pixels.shape[0]
    x = vision_tokens(p, pixels, c)
    pooled = _norm(x[:, 0], p["vision_model.post_layernorm.weight"],
                   p["vision_model.post_layernorm.bias"], "layernorm", eps)
    image = F.linear(pooled, p["visual_projection.weight"])

    n, t = ids.shape
    y = p["text_model.embeddings.token_embedding"][ids] + \
        p["text_model.embeddings.position_embedding"][:t].unsqueeze(0)
    y = _layers(p, "text_model.encoder.layers.", y, c["text_layers"], c["text_heads"], "causal", c)
    y = _norm(y, p["text_model.final_layer_norm.weight"], p["text_model.final_layer_norm.bias"],
              "layernorm", eps)
    eos = y[torch.arange(n), lengths - 1]
    text = F.linear(eos, p["text_projection.weight"])

    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    scale = p["logit_scale"].clamp(max=math.log(100.0)).exp()
    logits_per_text = scale * text @ image.t()
    target = torch.arange(b)
    loss = (F.cross_entropy(logits_per_text, target) +
            F.cross_entropy(logits_per_text.t(), target)) / 2
    return loss, image, text


@op("clip")
def clip(t, args):
    params = {n: v.double().requires_grad_() for n, v in t.items()
              if n not in ("pixels", "text_ids", "text_lengths")}
    loss, image, text = clip_forward(params, t["pixels"].double(), t["text_ids"].long(),
                                     t["text_lengths"].long(), args["config"])
    loss.backward()
    out = {"loss": loss.reshape(1), "image_features": image.detach(),
           "text_features": text.detach()}
    out.update({n + ".grad": p.grad.clone() for n, p in params.items()})
    return out

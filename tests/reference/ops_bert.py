"""BERT (src/models/bert.cpp) in float64 with autograd, built from octet's state_dict names.

Word + position + token-type embeddings (and their LayerNorm when post-LN); encoder
TransformerLayers with a padding mask (post-LN: LayerNorm(x + attention) is the MLP's input and
residual, the output LayerNorm closes the layer; pre-LN: norms before attention and MLP and a
final LayerNorm); the MLM head over the positions whose target is not -100 (dense, activation,
LayerNorm, the word embedding as decoder plus cls.predictions.bias); the NSP head (pooler:
dense + tanh over [CLS], then two classes). Loss = mean MLM cross-entropy + mean NSP
cross-entropy, as Hugging Face's BertForPreTraining. Dropout is 0.

Op "bert": the loss, both losses, the MLM and NSP logits and every parameter's gradient."""
import torch
import torch.nn.functional as F

from ops_modules import _ACT
from ops_transformer import _mha, _mlp, _norm
from registry import op


def bert_forward(p, ids, types, lengths, targets, nsp_labels, c):
    b, t = ids.shape
    heads, eps = c["num_heads"], c.get("layernorm_eps", 1e-12)
    post = c.get("post_layernorm", True)
    act = c.get("activation", "gelu_erf")
    args = {"heads": heads, "gqa_groups": heads, "kv_channels": c["hidden"] // heads,
            "norm": "layernorm", "eps": eps, "mask": "padding", "activation": act}
    lens = {"q_lengths": lengths, "kv_lengths": lengths}
    x = (p["bert.embeddings.word_embeddings.weight"][ids]
         + p["bert.embeddings.position_embeddings.weight"][:t].unsqueeze(0)
         + p["bert.embeddings.token_type_embeddings.weight"][types])

    def norm(name, inp):
        return _norm(inp, p[name + ".weight"], p[name + ".bias"], "layernorm", eps)

    if post:
        x = norm("bert.embeddings.LayerNorm", x)
    for i in range(c["num_layers"]):
        prefix = "bert.encoder.layer.%d." % i
        attn, bias = _mha(p, prefix + "self_attention.", x, None, args, lens)
        h = x + attn + bias
        if post:
            h = norm(prefix + "layernorm_mlp.norm", h)
            # _mlp normalizes its input with layernorm_mlp.norm: give it the unnormed sum.
            mlp = _mlp(p, prefix + "layernorm_mlp.", x + attn + bias, args)
            x = norm(prefix + "layernorm", h + mlp)
        else:
            x = h + _mlp(p, prefix + "layernorm_mlp.", h, args)
    if not post:
        x = norm("bert.encoder.ln", x)
    flat = x.reshape(b * t, -1)
    rows = (targets.reshape(-1) != -100).nonzero().reshape(-1)
    m = F.linear(flat[rows], p["cls.predictions.transform.dense.weight"],
                 p["cls.predictions.transform.dense.bias"])
    m = norm("cls.predictions.transform.LayerNorm", _ACT[act](m))
    mlm_logits = F.linear(m, p["bert.embeddings.word_embeddings.weight"],
                          p["cls.predictions.bias"])
    mlm = F.cross_entropy(mlm_logits, targets.reshape(-1)[rows])
    pooled = torch.tanh(F.linear(x[:, 0], p["bert.pooler.dense.weight"],
                                 p["bert.pooler.dense.bias"]))
    nsp_logits = F.linear(pooled, p["cls.seq_relationship.weight"], p["cls.seq_relationship.bias"])
    nsp = F.cross_entropy(nsp_logits, nsp_labels)
    return mlm + nsp, mlm, nsp, mlm_logits, nsp_logits


@op("bert")
def bert(t, args):
    inputs = ("ids", "token_types", "lengths", "targets", "nsp_labels")
    params = {n: v.double().requires_grad_() for n, v in t.items() if n not in inputs}
    loss, mlm, nsp, mlm_logits, nsp_logits = bert_forward(
        params, t["ids"].long(), t["token_types"].long(), t["lengths"], t["targets"].long(),
        t["nsp_labels"].long(), args["config"])
    loss.backward()
    out = {"loss": loss.reshape(1), "mlm_loss": mlm.reshape(1), "nsp_loss": nsp.reshape(1),
           "mlm_logits": mlm_logits, "nsp_logits": nsp_logits}
    out.update({n + ".grad": p.grad.clone() for n, p in params.items()})
    return out

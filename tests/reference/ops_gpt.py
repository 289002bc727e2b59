"""GPT (src/models/gpt.cpp) in float64 with autograd, built from octet's state_dict names.

wte[ids] (+ wpe[:T]) -> pre-norm TransformerLayers (the same functions ops_transformer.py
checks TransformerLayer against) -> final norm transformer.ln_f -> logits = x wte^T (tied)
-> cross-entropy with ignore_index -100, mean over the valid targets. Dropout is 0.

Op "gpt": one step on batch 0 (loss, the last position's logits, every parameter's gradient),
then `steps` training steps with torch.optim.AdamW (weight decay on >= 2-D parameters only),
clip_grad_norm_ and a constant learning rate, on batch s % S of ids / targets [S,B,T]."""
import torch
import torch.nn.functional as F

from ops_transformer import _mha, _mlp, _norm
from registry import op


def _layer_args(c):
    heads = c["num_heads"]
    head_dim = c["hidden"] // heads
    return {
        "heads": heads,
        "gqa_groups": c.get("num_gqa_groups", 0) or heads,
        "kv_channels": head_dim,
        "norm": c.get("normalization", "layernorm"),
        "eps": c.get("layernorm_eps", 1e-5),
        "mask": "causal",
        "rope": c.get("position_embedding", "learned") == "rope",
        "rotary_dim": head_dim,
        "rope_theta": c.get("rope_theta", 10000.0),
        "activation": c.get("activation", "gelu"),
    }


def gpt_forward(p, ids, targets, c):
    """ids, targets [B,T] int64 -> (mean loss, logits of the last position [B,V])."""
    args = _layer_args(c)
    t = ids.shape[1]
    wte = p["transformer.wte.weight"]
    x = wte[ids]
    if "transformer.wpe.weight" in p:
        x = x + p["transformer.wpe.weight"][:t]
    for i in range(c["num_layers"]):
        prefix = "transformer.h.%d." % i
        attn, bias = _mha(p, prefix + "self_attention.", x, None, args, {})
        h = x + (attn if bias is None else attn + bias)
        x = h + _mlp(p, prefix + "layernorm_mlp.", h, args)
    x = _norm(x, p["transformer.ln_f.weight"], p.get("transformer.ln_f.bias"), args["norm"],
              args["eps"])
    logits = x @ wte.t()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100)
    return loss, logits[:, -1]


@op("gpt")
def gpt(t, args):
    c = args["config"]
    params = {n: v.double().requires_grad_() for n, v in t.items() if n.startswith("transformer.")}
    ids, targets = t["ids"].long(), t["targets"].long()
    if ids.dim() == 2:
        ids, targets = ids.unsqueeze(0), targets.unsqueeze(0)

    loss, last_logits = gpt_forward(params, ids[0], targets[0], c)
    loss.backward()
    out = {"loss": loss.reshape(1), "last_logits": last_logits}
    out.update({n + ".grad": p.grad.clone() for n, p in params.items()})

    steps = args.get("steps", 0)
    if steps:
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args["weight_decay"]},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=args["lr"], betas=(args["beta1"], args["beta2"]), eps=args["eps"])
        losses, norms = [], []
        for s in range(steps):
            optimizer.zero_grad()
            loss, _ = gpt_forward(params, ids[s % ids.shape[0]], targets[s % ids.shape[0]], c)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), args["clip_grad"])
            optimizer.step()
            losses.append(loss.item())
            norms.append(float(norm))
        out["losses"] = torch.tensor(losses, dtype=torch.float64)
        out["grad_norms"] = torch.tensor(norms, dtype=torch.float64)
        out.update({n + ".final": p for n, p in params.items()})
    return out

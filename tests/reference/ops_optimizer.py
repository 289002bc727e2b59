"""Optimizer references: torch.optim.AdamW and torch.nn.utils.clip_grad_norm_, float64."""
import torch

from registry import op


def _indexed(t, prefix):
    """Tensors named prefix0, prefix1, ... in index order."""
    count = sum(1 for name in t if name.startswith(prefix) and name[len(prefix):].isdigit())
    return [t[f"{prefix}{i}"] for i in range(count)]


@op("adamw")
def adamw(t, args):
    """Inputs param{i} and grad{i}_{step} for step in [0, steps); args: lr, betas, eps,
    weight_decays (one per tensor), steps. One param group per tensor (its own weight decay).
    Returns param{i}, exp_avg{i}, exp_avg_sq{i} after the steps."""
    params = [p.double().clone().requires_grad_(True) for p in _indexed(t, "param")]
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(params, args["weight_decays"])]
    optimizer = torch.optim.AdamW(groups, lr=args["lr"], betas=tuple(args["betas"]),
                                  eps=args["eps"])
    for step in range(args["steps"]):
        for i, p in enumerate(params):
            p.grad = t[f"grad{i}_{step}"].double().clone()
        optimizer.step()
    out = {}
    for i, p in enumerate(params):
        state = optimizer.state[p]
        out[f"param{i}"] = p.detach()
        out[f"exp_avg{i}"] = state["exp_avg"]
        out[f"exp_avg_sq{i}"] = state["exp_avg_sq"]
    return out


@op("clip_grad_norm")
def clip_grad_norm(t, args):
    """Inputs grad{i}; args: max_norm. Returns norm [1] and the clipped grad{i}."""
    params = []
    for g in _indexed(t, "grad"):
        p = torch.zeros_like(g, dtype=torch.float64, requires_grad=True)
        p.grad = g.double().clone()
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, args["max_norm"])
    out = {"norm": norm.reshape(1)}
    for i, p in enumerate(params):
        out[f"grad{i}"] = p.grad
    return out

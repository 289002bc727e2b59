"""LayerNorm and RMSNorm references (float64, autograd for the backward)."""
import torch
import torch.nn.functional as F

from registry import op


def _norm(t, args, rms):
    x = t["x"].double().requires_grad_()
    gamma = t["gamma"].double().requires_grad_()
    beta = t["beta"].double().requires_grad_() if "beta" in t else None
    weight = gamma + 1 if args.get("zero_centered_gamma") else gamma
    if rms:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args["eps"]) * weight
    else:
        y = F.layer_norm(x, (x.shape[-1],), weight, beta, args["eps"])
    y.backward(t["dy"].double())
    out = {"y": y, "dx": x.grad, "dgamma": gamma.grad}
    if beta is not None:
        out["dbeta"] = beta.grad
    return out


@op("layernorm")
def layernorm(t, args):
    return _norm(t, args, rms=False)


@op("rmsnorm")
def rmsnorm(t, args):
    return _norm(t, args, rms=True)

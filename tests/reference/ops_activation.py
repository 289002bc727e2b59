"""Activation references (float64, autograd for the backward)."""
import torch
import torch.nn.functional as F

from registry import op

_PLAIN = {
    "gelu": lambda a: F.gelu(a, approximate="tanh"),
    "gelu_erf": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}
_GATED = {"swiglu": F.silu, "geglu": lambda a: F.gelu(a, approximate="tanh")}


@op("activation")
def activation(t, args):
    kind = args["kind"]
    x = t["x"].double().requires_grad_()
    bias = t["bias"].double().requires_grad_() if "bias" in t else None
    h = x + bias if bias is not None else x
    if kind in _GATED:
        a, b = h.chunk(2, dim=-1)
        y = _GATED[kind](a) * b
    else:
        y = _PLAIN[kind](h)
    y.backward(t["dy"].double())
    out = {"y": y, "dx": x.grad}
    if bias is not None:
        out["dbias"] = bias.grad
    return out

"""Module references: Linear, LayerNormLinear, LayerNormMLP in float64 with autograd."""
import torch
import torch.nn.functional as F

from registry import op

_ACT = {
    "gelu": lambda a: F.gelu(a, approximate="tanh"),
    "gelu_erf": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}
_GATED = {"swiglu": F.silu, "geglu": lambda a: F.gelu(a, approximate="tanh")}


def _leaf(t, name):
    return t[name].double().requires_grad_() if name in t else None


def _norm(x, weight, bias, args):
    if args.get("norm", "layernorm") == "rmsnorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args["eps"]) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, bias, args["eps"])


def _grads(out, leaves):
    return {name + ".grad": leaf.grad for name, leaf in leaves.items() if leaf is not None}


@op("linear")
def linear(t, args):
    leaves = {n: _leaf(t, n) for n in ("x", "weight", "bias")}
    y = F.linear(leaves["x"], leaves["weight"], leaves["bias"])
    y.backward(t["dy"].double())
    return {"y": y, **_grads(y, leaves)}


@op("layernorm_linear")
def layernorm_linear(t, args):
    leaves = {n: _leaf(t, n) for n in ("x", "norm.weight", "norm.bias", "weight", "bias")}
    h = _norm(leaves["x"], leaves["norm.weight"], leaves["norm.bias"], args)
    y = F.linear(h, leaves["weight"], leaves["bias"])
    y.backward(t["dy"].double())
    return {"y": y, **_grads(y, leaves)}


@op("layernorm_mlp")
def layernorm_mlp(t, args):
    names = ("x", "norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    leaves = {n: _leaf(t, n) for n in names}
    h = _norm(leaves["x"], leaves["norm.weight"], leaves["norm.bias"], args)
    h = F.linear(h, leaves["fc1.weight"], leaves["fc1.bias"])
    kind = args["activation"]
    if kind in _GATED:
        a, b = h.chunk(2, dim=-1)
        h = _GATED[kind](a) * b
    else:
        h = _ACT[kind](h)
    y = F.linear(h, leaves["fc2.weight"], leaves["fc2.bias"])
    y.backward(t["dy"].double())
    return {"y": y, **_grads(y, leaves)}

"""Bias + dropout + residual reference. The keep mask comes from octet's RNG (an input),
since torch's generator is a different one; the arithmetic and the gradients are torch's."""
from registry import op


@op("bias_dropout_add")
def bias_dropout_add(t, args):
    p = args["p"]
    x = t["x"].double().requires_grad_()
    bias = t["bias"].double().requires_grad_()
    residual = t["residual"].double().requires_grad_()
    mask = t["mask"].double()
    out = residual + (x + bias) * mask / (1 - p)
    out.backward(t["dout"].double())
    return {"out": out, "dx": x.grad, "dbias": bias.grad, "dresidual": residual.grad}

"""Elementwise references: torch in float64, autograd for the bias gradient."""
import torch

from registry import op


@op("elementwise")
def elementwise(t, args):
    """x [N,C], out [N,C], alpha [1], bias [C], dy [N,C] ->
    scaled = out + alpha * x, biased = x + bias, and dbias = the gradient of bias in
    (x + bias) * dy summed (the column sums of dy)."""
    x = t["x"].double()
    alpha = float(t["alpha"].double()[0])
    bias = t["bias"].double().requires_grad_(True)
    biased = x + bias
    (biased * t["dy"].double()).sum().backward()
    return {"scaled": t["out"].double() + alpha * x, "biased": biased.detach(),
            "dbias": bias.grad}

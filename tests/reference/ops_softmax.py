"""Scaled masked softmax (TransformerEngine's fused softmax family), float64 with autograd."""
import torch

from registry import op


def masked_positions(t, args, shape):
    """Bool [B,1,Tq,Tk]: True where the key is masked for the query."""
    b, _, tq, tk = shape
    i = torch.arange(tq).view(1, 1, tq, 1)
    j = torch.arange(tk).view(1, 1, 1, tk)
    kind = args.get("mask", "none")
    if kind == "causal":  # bottom-right aligned when Tq != Tk
        return (j > i + (tk - tq)).expand(b, 1, tq, tk)
    if kind == "padding":
        lengths = t["key_lengths"].long().view(b, 1, 1, 1)
        return (j >= lengths).expand(b, 1, tq, tk)
    if kind == "arbitrary":
        return (t["mask"] != 0).expand(b, 1, tq, tk)
    return torch.zeros(b, 1, tq, tk, dtype=torch.bool)


@op("scaled_masked_softmax")
def scaled_masked_softmax(t, args):
    x = t["x"].double().requires_grad_()
    masked = masked_positions(t, args, x.shape)
    visible_row = (~masked).any(-1, keepdim=True)
    scores = (x * args["scale"]).masked_fill(masked, float("-inf"))
    scores = torch.where(visible_row, scores, torch.zeros_like(scores))
    y = torch.softmax(scores, -1) * visible_row  # fully masked rows are zeros
    y.backward(t["dy"].double())
    return {"y": y, "dx": x.grad}

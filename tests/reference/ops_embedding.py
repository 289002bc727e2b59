"""Embedding reference: torch.nn.functional.embedding in float64, with autograd."""
import torch
import torch.nn.functional as F

from registry import op


@op("embedding")
def embedding(t, args):
    """ids [*], table [V,C], dout [*,C] -> out [*,C] and dtable = sum of dout over each id."""
    table = t["table"].double().requires_grad_(True)
    out = F.embedding(t["ids"].long(), table)
    out.backward(t["dout"].double())
    return {"out": out, "dtable": table.grad}

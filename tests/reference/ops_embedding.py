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


@op("position_embedding")
def position_embedding(t, args):
    """x [R,C] rows first_row.. of a [B*T,C] token matrix, table [P,C], dout [R,C] ->
    out = x + table[offset + (first_row + r) % T] and dtable (the sum of dout per position)."""
    seq_len, first_row, offset = (int(v) for v in t["sizes"].tolist())
    rows = t["x"].shape[0]
    positions = offset + (first_row + torch.arange(rows)) % seq_len
    table = t["table"].double().requires_grad_(True)
    out = t["x"].double() + table[positions]
    out.backward(t["dout"].double())
    return {"out": out, "dtable": table.grad}

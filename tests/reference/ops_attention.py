"""Attention the explicit way: softmax(Q K^T * scale + bias + mask) (dropout) V in float64,
with autograd for dq, dk, dv and, given a "bias" input [H,T,S] (shared over the batch), its
gradient "dbias". The dropout mask arrives as an input (keep [B,H,T,S] U8) made by
octet's own RNG, so both sides drop the same probabilities."""
import torch

from registry import op


def visible_keys(t, args, b, tq, tk):
    """Bool [B,1,T,S]: True where query i may see key j (bottom-right aligned masks)."""
    i = torch.arange(tq).view(1, tq, 1)
    j = torch.arange(tk).view(1, 1, tk)
    q_len = t["q_lengths"].long().view(b, 1, 1) if "q_lengths" in t else torch.full((b, 1, 1), tq)
    kv_len = t["kv_lengths"].long().view(b, 1, 1) if "kv_lengths" in t else torch.full((b, 1, 1), tk)
    diagonal = i + kv_len - q_len
    visible = (i < q_len) & (j < kv_len)
    left, right = args.get("window_left", -1), args.get("window_right", -1)
    if args.get("causal", False):
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    return visible.unsqueeze(1)


@op("attention")
def attention(t, args):
    q = t["q"].double().requires_grad_()
    k = t["k"].double().requires_grad_()
    v = t["v"].double().requires_grad_()
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    scale = args.get("scale", 0.0) or d ** -0.5
    kk = k.repeat_interleave(group, dim=2)  # dk, dv sum over each group through autograd
    vv = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    if "bias" in t:
        bias = t["bias"].double().requires_grad_()
        scores = scores + bias  # broadcast over b: autograd sums dbias over the batch
    visible = visible_keys(t, args, b, tq, tk)
    visible_row = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.where(visible_row.squeeze(-1), torch.logsumexp(scores, -1),
                      torch.full(scores.shape[:-1], float("inf"), dtype=torch.float64))
    scores = torch.where(visible_row, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, -1) * visible_row
    if "keep" in t:
        probs = probs * t["keep"].double() / (1.0 - args["dropout"])
    out = torch.einsum("bhts,bshd->bthd", probs, vv)
    out.backward(t["dout"].double())
    result = {"out": out, "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if "bias" in t:
        result["dbias"] = bias.grad
    return result

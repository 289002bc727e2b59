"""Rotary position embedding in float64, both pair layouts, with autograd for the backward."""
import torch

from registry import op


def rope(x, rotary_dim, theta, offset, interleaved):
    t = x.shape[1]
    half = rotary_dim // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    angle = (offset + torch.arange(t, dtype=torch.float64)).view(t, 1) * inv_freq
    cos = angle.cos().view(1, t, 1, half)
    sin = angle.sin().view(1, t, 1, half)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([out, rest], dim=-1)


@op("rope")
def rope_op(t, args):
    x = t["x"].double().requires_grad_()
    rotary_dim = args.get("rotary_dim", 0) or x.shape[-1]
    y = rope(x, rotary_dim, args.get("theta", 10000.0), args.get("offset", 0),
             args.get("interleaved", False))
    y.backward(t["dy"].double())
    return {"y": y, "dx": x.grad}

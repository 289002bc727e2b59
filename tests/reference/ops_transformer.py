"""Attention modules, TransformerLayer and GroupedLinear in float64 with autograd.

Attention is written out: softmax(Q K^T * scale + mask) V, K and V repeated per query group
(GQA); RoPE rotates halves (or interleaved pairs); QK-norm normalizes each head over D.
Dropout is 0 here (it is tested on its own). Parameters arrive under the module's names with
its prefix stripped; every input named like a parameter is a leaf and gets a gradient."""
import torch
import torch.nn.functional as F

from ops_attention import visible_keys
from ops_modules import _ACT, _GATED
from ops_rope import rope
from registry import op


def _leaves(t):
    return {n: v.double().requires_grad_() for n, v in t.items()
            if n not in ("dy", "lengths", "encoder_lengths", "m_splits")}


def _norm(x, w, b, kind, eps, zero_centered=False):
    if zero_centered:
        w = 1 + w
    if kind == "rmsnorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _attention(q, k, v, args, lengths):
    """q [B,T,H,D], k, v [B,S,Hkv,D] -> [B,T,H,D]; rows with no visible key give 0."""
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(h // hkv, dim=2)
    vv = v.repeat_interleave(h // hkv, dim=2)
    scale = args.get("softmax_scale", 0.0) or d ** -0.5
    scores = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    mask = args.get("mask", "causal")
    window = args.get("window", [-1, -1])
    mask_args = {"causal": mask in ("causal", "padding_causal"),
                 "window_left": window[0], "window_right": window[1]}
    visible = visible_keys(lengths if mask.startswith("padding") else {}, mask_args, b, tq, tk)
    row_visible = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf"))
    scores = torch.where(row_visible, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, -1) * row_visible
    return torch.einsum("bhts,bshd->bthd", probs, vv)


def _mha(p, prefix, x, enc, args, lengths):
    """Returns (output without the projection bias, the projection bias or None)."""
    P = lambda name: p.get(prefix + name)
    h, hkv, d = args["heads"], args["gqa_groups"], args["kv_channels"]
    b, t, _ = x.shape
    kind, eps = args.get("norm", "layernorm"), args.get("eps", 1e-5)
    zc = args.get("zero_centered_gamma", False)

    def project(name, inp):
        if P(name + ".norm.weight") is not None:
            inp = _norm(inp, P(name + ".norm.weight"), P(name + ".norm.bias"), kind, eps, zc)
        return F.linear(inp, P(name + ".weight"), P(name + ".bias"))

    if args.get("cross", False):
        q = project("layernorm_query" if P("layernorm_query.weight") is not None else "query", x)
        k, v = project("key_value", enc).split([hkv * d, hkv * d], -1)
        s = enc.shape[1]
    else:
        name = "layernorm_qkv" if P("layernorm_qkv.weight") is not None else "qkv"
        q, k, v = project(name, x).split([h * d, hkv * d, hkv * d], -1)
        s = t
    q, k, v = q.reshape(b, t, h, d), k.reshape(b, s, hkv, d), v.reshape(b, s, hkv, d)

    def qk_norm(q, k):
        nk, neps = args.get("qk_norm_type", "rmsnorm"), args.get("qk_norm_eps", 1e-6)
        return (_norm(q, P("q_norm.weight"), P("q_norm.bias"), nk, neps),
                _norm(k, P("k_norm.weight"), P("k_norm.bias"), nk, neps))

    qk = args.get("qk_norm", False)
    if qk and args.get("qk_norm_before_rope", False):
        q, k = qk_norm(q, k)
    if args.get("rope", False):
        rd = args["rotary_dim"]
        q = rope(q, rd, args.get("rope_theta", 10000.0), 0, args.get("interleaved", False))
        k = rope(k, rd, args.get("rope_theta", 10000.0), 0, args.get("interleaved", False))
    if qk and not args.get("qk_norm_before_rope", False):
        q, k = qk_norm(q, k)
    o = _attention(q, k, v, args, lengths).reshape(b, t, h * d)
    y = F.linear(o, P("proj.weight"))
    return y, P("proj.bias")


def _with_bias(y, bias):
    return y if bias is None else y + bias


def _mlp(p, prefix, x, args):
    P = lambda name: p.get(prefix + name)
    h = _norm(x, P("norm.weight"), P("norm.bias"), args.get("norm", "layernorm"),
              args.get("eps", 1e-5), args.get("zero_centered_gamma", False))
    h = F.linear(h, P("fc1.weight"), P("fc1.bias"))
    kind = args.get("activation", "gelu")
    if kind in _GATED:
        a, g = h.chunk(2, dim=-1)
        h = _GATED[kind](a) * g
    else:
        h = _ACT[kind](h)
    return F.linear(h, P("fc2.weight"), P("fc2.bias"))


def _lengths(t, self_attention):
    if "lengths" not in t:
        return {}
    out = {"q_lengths": t["lengths"]}
    if self_attention:
        out["kv_lengths"] = t["lengths"]
    elif "encoder_lengths" in t:
        out["kv_lengths"] = t["encoder_lengths"]
    return out


def _backward(out, t, p, extra):
    out.backward(t["dy"].double())
    grads = {n + ".grad": leaf.grad for n, leaf in p.items() if leaf.grad is not None}
    return {"y": out, **grads, **extra}


@op("dot_product_attention")
def dot_product_attention(t, args):
    p = _leaves(t)
    lengths = {n: t[n] for n in ("q_lengths", "kv_lengths") if n in t}
    y = _attention(p["q"], p["k"], p["v"], args, lengths)
    return _backward(y, t, p, {})


@op("multihead_attention")
def multihead_attention(t, args):
    p = _leaves(t)
    y, bias = _mha(p, "", p["x"], p.get("encoder_output"), args, _lengths(t, not args.get("cross")))
    return _backward(_with_bias(y, bias), t, p, {})


@op("transformer_layer")
def transformer_layer(t, args):
    """TransformerEngine's TransformerLayer.forward with dropout 0."""
    p = _leaves(t)
    x, enc = p["x"], p.get("encoder_output")
    post = args.get("post_layernorm_residual", False)
    output_ln = args.get("output_layernorm", False)
    kind, eps, zc = args.get("norm", "layernorm"), args.get("eps", 1e-5), args.get("zero_centered_gamma", False)

    def norm_of(prefix, inp):
        return _norm(inp, p[prefix + ".weight"], p.get(prefix + ".bias"), kind, eps, zc)

    self_args = dict(args, cross=False)
    attn, bias = _mha(p, "self_attention.", x, None, self_args, _lengths(t, True))
    residual = norm_of("self_attention.layernorm_qkv.norm", x) if post and not output_ln else x
    h = residual + _with_bias(attn, bias)
    if args.get("parallel_attention_mlp", False):
        out = h + _mlp(p, "layernorm_mlp.", x, args)
    else:
        if enc is not None:
            cross_args = dict(args, cross=True, rope=False, mask=args.get("cross_mask", "no_mask"),
                              window=[-1, -1])
            cross, cbias = _mha(p, "inter_attention.", h, enc, cross_args, _lengths(t, False))
            residual = norm_of("inter_attention.layernorm_query.norm", h) if post else h
            h = residual + _with_bias(cross, cbias)
        residual = norm_of("layernorm_mlp.norm", h) if post else h
        out = residual + _mlp(p, "layernorm_mlp.", h, args)
    if output_ln:
        out = norm_of("layernorm", out)
    return _backward(out, t, p, {})


@op("grouped_linear")
def grouped_linear(t, args):
    p = _leaves(t)
    splits = args["m_splits"]
    outs = []
    for i, part in enumerate(p["x"].split(splits, 0)):
        outs.append(F.linear(part, p["weight%d" % i], p.get("bias%d" % i)))
    return _backward(torch.cat(outs, 0), t, p, {})

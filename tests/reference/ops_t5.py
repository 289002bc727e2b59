"""T5 v1.1 (src/models/t5.cpp) in float64 with autograd, built from octet's state_dict names.

Shared token embedding; encoder: pre-RMSNorm layers (self-attention with the encoder's relative
position bias, bidirectional buckets, padding mask; GEGLU MLP), final RMSNorm; decoder: the
same with causal self-attention and its own (causal-bucket) bias, then cross-attention over the
encoder's output (padding mask on the encoder's lengths), final RMSNorm; untied output layer;
cross-entropy mean over targets != -100. Scores are not scaled (T5). No biases in linear
layers. Queries past their sequence's length give 0 (octet's convention; never in the loss).

Op "t5": the loss, the logits and every parameter's gradient."""
import math

import torch
import torch.nn.functional as F

from registry import op


def bucket(rp, bidirectional, num_buckets, max_distance):
    """Hugging Face's T5 _relative_position_bucket."""
    ret = torch.zeros_like(rp)
    n = num_buckets
    if bidirectional:
        n //= 2
        ret += (rp > 0).to(torch.long) * n
        rp = torch.abs(rp)
    else:
        rp = -torch.min(rp, torch.zeros_like(rp))
    max_exact = n // 2
    is_small = rp < max_exact
    large = max_exact + (torch.log(rp.float() / max_exact) / math.log(max_distance / max_exact)
                         * (n - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, n - 1))
    return ret + torch.where(is_small, rp, large)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def attention(xq, xkv, wq, wk, wv, wo, heads, d, bias, q_len, kv_len, causal):
    b, t, _ = xq.shape
    s = xkv.shape[1]
    q = F.linear(xq, wq).view(b, t, heads, d)
    k = F.linear(xkv, wk).view(b, s, heads, d)
    v = F.linear(xkv, wv).view(b, s, heads, d)
    scores = torch.einsum("bthd,bshd->bhts", q, k)
    if bias is not None:
        scores = scores + bias.unsqueeze(0)
    i = torch.arange(t).view(1, t, 1)
    j = torch.arange(s).view(1, 1, s)
    visible = j < kv_len.view(b, 1, 1)
    if causal:
        visible = visible & (j <= i)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    p = torch.softmax(scores, -1)
    o = torch.einsum("bhts,bshd->bthd", p, v)
    o = o * (i.view(1, t, 1, 1) < q_len.view(b, 1, 1, 1))  # padded queries give 0
    return F.linear(o.reshape(b, t, heads * d), wo)


def t5_forward(p, enc_ids, enc_len, dec_ids, dec_len, targets, c):
    heads, d, eps = c["num_heads"], c["kv_channels"], c.get("layernorm_eps", 1e-6)
    nb, md = c.get("relative_attention_num_buckets", 32), c.get("relative_attention_max_distance", 128)
    s, t = enc_ids.shape[1], dec_ids.shape[1]
    a = heads * d

    def rel_bias(table, length, bidirectional):
        pos = torch.arange(length)
        rp = pos.view(1, -1) - pos.view(-1, 1)  # key - query
        return table[bucket(rp, bidirectional, nb, md)].permute(2, 0, 1)  # [H, T, S]

    def mlp(prefix, x):
        h = F.linear(rms(x, p[prefix + "norm.weight"], eps), p[prefix + "fc1.weight"])
        g0, g1 = h.chunk(2, -1)
        return F.linear(F.gelu(g0, approximate="tanh") * g1, p[prefix + "fc2.weight"])

    def self_attn(prefix, x, bias, length, causal):
        wq, wk, wv = p[prefix + "layernorm_qkv.weight"].split([a, a, a], 0)
        xn = rms(x, p[prefix + "layernorm_qkv.norm.weight"], eps)
        return attention(xn, xn, wq, wk, wv, p[prefix + "proj.weight"], heads, d, bias, length,
                         length, causal)

    shared = p["shared.weight"]
    x = shared[enc_ids]
    enc_bias = rel_bias(p["encoder.relative_attention_bias.weight"], s, True)
    for i in range(c["num_layers"]):
        pre = "encoder.layer.%d." % i
        x = x + self_attn(pre + "self_attention.", x, enc_bias, enc_len, False)
        x = x + mlp(pre + "layernorm_mlp.", x)
    enc = rms(x, p["encoder.final_layer_norm.weight"], eps)
    y = shared[dec_ids]
    dec_bias = rel_bias(p["decoder.relative_attention_bias.weight"], t, False)
    for i in range(c.get("num_decoder_layers", 0) or c["num_layers"]):
        pre = "decoder.layer.%d." % i
        y = y + self_attn(pre + "self_attention.", y, dec_bias, dec_len, True)
        cross = pre + "inter_attention."
        wk, wv = p[cross + "key_value.weight"].split([a, a], 0)
        yn = rms(y, p[cross + "layernorm_query.norm.weight"], eps)
        y = y + attention(yn, enc, p[cross + "layernorm_query.weight"], wk, wv,
                          p[cross + "proj.weight"], heads, d, None, dec_len, enc_len, False)
        y = y + mlp(pre + "layernorm_mlp.", y)
    hidden = rms(y, p["decoder.final_layer_norm.weight"], eps)
    logits = F.linear(hidden, p["lm_head.weight"])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100)
    return loss, logits


@op("t5")
def t5(t, args):
    inputs = ("enc_ids", "enc_lengths", "dec_ids", "dec_lengths", "targets")
    params = {n: v.double().requires_grad_() for n, v in t.items() if n not in inputs}
    loss, logits = t5_forward(params, t["enc_ids"].long(), t["enc_lengths"].long(),
                              t["dec_ids"].long(), t["dec_lengths"].long(), t["targets"].long(),
                              args["config"])
    loss.backward()
    out = {"loss": loss.reshape(1), "logits": logits}
    out.update({n + ".grad": p.grad.clone() for n, p in params.items()})
    return out

"""The T5 of `octet bench train`'s peer (bench/peers/torch_train.py runs it), eager PyTorch 1.13.

As octet's T5 v1.1 (src/models/t5.cpp; tests/reference/ops_t5.py is the same math in float64):
one shared token embedding; encoder layers x + attention(RMSNorm(x)), x + GEGLU(RMSNorm(x))
with one fused QKV linear, the encoder's relative position bias (bidirectional buckets) and the
padding mask from the encoder's lengths, then a final RMSNorm; decoder layers the same with
causal self-attention and the decoder's own bias (causal buckets), then cross-attention over
the encoder's output (a query linear, one fused key-value linear, the encoder's padding mask),
then a final RMSNorm; the untied output layer and the mean cross-entropy over targets != -100.
No biases in linear layers; attention scores are not scaled (T5 folds 1/sqrt(d_kv) into the
query's initialization); GEGLU is GELU-tanh of the first half of FC1 times its second half, as
octet's GeGlu. torch 1.13 has no fused attention and no RMSNorm: both are explicit. As Hugging
Face's T5, each stack adds its position bias and mask once ([B,H,T,S] FP32) and every layer
adds that to its scores, so the softmax runs in FP32 under autocast. The residual stream stays
FP32 as torch_gpt.py's. Queries past a sequence's length are not zeroed (octet zeroes them):
padded keys are masked and padded targets are -100, so they never reach the loss.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def check_config(config):
    if config.get("model") != "t5":
        raise SystemExit(f"torch_t5.py: config model={config.get('model')!r} is not 't5'")
    if config.get("dropout", 0.0) != 0.0:
        raise SystemExit(f"torch_t5.py: config dropout={config['dropout']!r} is not supported "
                         "(expected 0)")


def relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Hugging Face's T5 _relative_position_bucket (tests/reference/ops_t5.py's bucket)."""
    bucket = torch.zeros_like(relative_position)
    n = num_buckets
    if bidirectional:
        n //= 2
        bucket += (relative_position > 0).long() * n
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = n // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact)
                         / math.log(max_distance / max_exact) * (n - max_exact)).long()
    large = torch.min(large, torch.full_like(large, n - 1))
    return bucket + torch.where(is_small, relative_position, large)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension (x is the FP32 residual
    stream, so this runs in FP32 under autocast)."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def attend(q, k, v, heads, bias):
    """q [B,T,A], k and v [B,S,A] -> [B,T,A]; bias [B,H,T,S] FP32 (position bias + mask)."""
    b, t, a = q.shape
    s, d = k.shape[1], a // heads
    q = q.view(b, t, heads, d).transpose(1, 2)  # [B,H,T,D]
    k = k.view(b, s, heads, d).transpose(1, 2)
    v = v.view(b, s, heads, d).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) + bias  # unscaled; FP32
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(1, 2).reshape(b, t, a)


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, kv_channels, eps):
        super().__init__()
        self.heads, self.inner = heads, heads * kv_channels
        self.norm = RMSNorm(hidden, eps)
        self.qkv = nn.Linear(hidden, 3 * self.inner, bias=False)
        self.proj = nn.Linear(self.inner, hidden, bias=False)

    def forward(self, x, bias):
        q, k, v = self.qkv(self.norm(x)).split(self.inner, dim=2)
        return self.proj(attend(q, k, v, self.heads, bias))


class CrossAttention(nn.Module):
    def __init__(self, hidden, heads, kv_channels, eps):
        super().__init__()
        self.heads, self.inner = heads, heads * kv_channels
        self.norm = RMSNorm(hidden, eps)
        self.query = nn.Linear(hidden, self.inner, bias=False)
        self.key_value = nn.Linear(hidden, 2 * self.inner, bias=False)
        self.proj = nn.Linear(self.inner, hidden, bias=False)

    def forward(self, y, encoded, mask):
        k, v = self.key_value(encoded).split(self.inner, dim=2)
        return self.proj(attend(self.query(self.norm(y)), k, v, self.heads, mask))


class GegluMlp(nn.Module):
    def __init__(self, hidden, ffn, eps):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)  # [wi_0 | wi_1]
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, linear = self.fc1(self.norm(x)).chunk(2, dim=-1)
        return self.fc2(F.gelu(gate, approximate="tanh") * linear)


class Layer(nn.Module):
    """An encoder layer, or a decoder layer (cross=True); x [B,T,C] FP32."""

    def __init__(self, config, cross):
        super().__init__()
        hidden, heads, d = config["hidden"], config["num_heads"], config["kv_channels"]
        eps = config.get("layernorm_eps", 1e-6)
        self.self_attention = SelfAttention(hidden, heads, d, eps)
        self.cross_attention = CrossAttention(hidden, heads, d, eps) if cross else None
        self.mlp = GegluMlp(hidden, config["ffn_hidden"], eps)

    def forward(self, x, bias, encoded=None, cross_mask=None):
        x = x + self.self_attention(x, bias)
        if self.cross_attention is not None:
            x = x + self.cross_attention(x, encoded, cross_mask)
        return x + self.mlp(x)


class T5(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_config(config)
        hidden, vocab, heads = config["hidden"], config["vocab_size"], config["num_heads"]
        eps = config.get("layernorm_eps", 1e-6)
        self.num_buckets = config.get("relative_attention_num_buckets", 32)
        self.max_distance = config.get("relative_attention_max_distance", 128)
        self.shared = nn.Embedding(vocab, hidden)
        self.encoder_bias = nn.Embedding(self.num_buckets, heads)
        self.encoder = nn.ModuleList(Layer(config, False) for _ in range(config["num_layers"]))
        self.encoder_norm = RMSNorm(hidden, eps)
        self.decoder_bias = nn.Embedding(self.num_buckets, heads)
        decoder_layers = config.get("num_decoder_layers", 0) or config["num_layers"]
        self.decoder = nn.ModuleList(Layer(config, True) for _ in range(decoder_layers))
        self.decoder_norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        # octet's initialization: fan-in scaling, the queries 1/sqrt(d_kv) smaller.
        inner = heads * config["kv_channels"]
        with torch.no_grad():
            nn.init.normal_(self.shared.weight, 0.0, config.get("init_std", 1.0))
            for name, p in self.named_parameters():
                if p.dim() != 2 or name == "shared.weight":
                    continue
                output = name.endswith("proj.weight") or name.endswith("fc2.weight")
                std = 1.0 / math.sqrt(config["ffn_hidden"] if output else hidden)
                nn.init.normal_(p, 0.0, std)
            for layer in list(self.encoder) + list(self.decoder):
                layer.self_attention.qkv.weight[:inner] /= math.sqrt(config["kv_channels"])
                if layer.cross_attention is not None:
                    layer.cross_attention.query.weight /= math.sqrt(config["kv_channels"])

    def position_bias(self, table, t, s, bidirectional, visible):
        """table's bias [H,T,S] plus -inf where `visible` [B,1,T,S] is False: [B,H,T,S] FP32."""
        positions_q, positions_k = torch.arange(t), torch.arange(s)
        buckets = relative_position_bucket(positions_k[None, :] - positions_q[:, None],
                                           bidirectional, self.num_buckets, self.max_distance)
        bias = table(buckets).permute(2, 0, 1).unsqueeze(0)  # [1,H,T,S]
        return bias.masked_fill(~visible, float("-inf"))

    def forward(self, enc_ids, enc_lengths, dec_ids, dec_lengths, targets):
        """enc_ids [B,S], dec_ids and targets [B,T] int64 (targets -100 on padding); lengths [B]
        int64. Returns the mean cross-entropy over the targets != -100."""
        b, s = enc_ids.shape
        t = dec_ids.shape[1]
        enc_keys = torch.arange(s)[None, :] < enc_lengths[:, None]  # [B,S]
        dec_keys = torch.arange(t)[None, :] < dec_lengths[:, None]  # [B,T]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        zeros = torch.zeros(b, 1, 1, s)  # the cross-attention's mask: no position bias
        cross_mask = zeros.masked_fill(~enc_keys.view(b, 1, 1, s), float("-inf"))
        # The encoder.
        x = self.shared(enc_ids)
        bias = self.position_bias(self.encoder_bias, s, s, True, enc_keys.view(b, 1, 1, s))
        for layer in self.encoder:
            x = layer(x, bias)
        encoded = self.encoder_norm(x)
        # The decoder.
        y = self.shared(dec_ids)
        bias = self.position_bias(self.decoder_bias, t, t, False,
                                  dec_keys.view(b, 1, 1, t) & causal.view(1, 1, t, t))
        for layer in self.decoder:
            y = layer(y, bias, encoded, cross_mask)
        logits = self.lm_head(self.decoder_norm(y))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)


def shortened(batch, length, generator):
    """Sequence lengths [B]: full, but every fourth sequence (b % 4 == 3) 1 .. length/4 tokens
    shorter (none shorter below 4 tokens), as octet's mock batch."""
    lengths = torch.full((batch,), length, dtype=torch.long)
    if length >= 4:
        cut = 1 + torch.randint(0, length // 4, (batch,), generator=generator)
        short = torch.arange(batch) % 4 == 3
        lengths[short] -= cut[short]
    return lengths


def mock_batch(config, batch, seq, target_len, generator):
    """A span-corruption-shaped micro-batch as octet's mock (bench_train.cpp): encoder ids of
    text with a sentinel at ~1/8 of the positions, [EOS] last, [PAD] after; targets text with a
    sentinel at ~1/4, [EOS] last, -100 after; the decoder's ids [PAD] then the targets shifted
    right. The tuple T5.forward takes."""
    if seq < 1 or seq > config["max_seq_len"]:
        raise SystemExit(f"torch_t5.py: encoder length expected in [1, {config['max_seq_len']}], "
                         f"got {seq}")
    if target_len < 1 or target_len > config["max_target_len"]:
        raise SystemExit(f"torch_t5.py: target length expected in [1, "
                         f"{config['max_target_len']}], got {target_len}")
    vocab, sentinels = config["vocab_size"], config["num_sentinels"]
    text_vocab = vocab - 2 - sentinels
    pad, eos = text_vocab, text_vocab + 1

    def text_with_sentinels(length, every):
        ids = torch.randint(0, text_vocab, (batch, length), generator=generator)
        marked = torch.randint(0, every, (batch, length), generator=generator) == 0
        # Sentinel k = vocab - 1 - k for the k-th marked position (k below num_sentinels).
        k = marked.long().cumsum(1) - 1
        marked &= k < sentinels
        return torch.where(marked, vocab - 1 - k, ids)

    def finish(ids, lengths, padding):
        positions = torch.arange(ids.shape[1])[None, :]
        ids = torch.where(positions == lengths[:, None] - 1, torch.full_like(ids, eos), ids)
        return torch.where(positions >= lengths[:, None], torch.full_like(ids, padding), ids)

    enc_lengths = shortened(batch, seq, generator)
    enc_ids = finish(text_with_sentinels(seq, 8), enc_lengths, pad)
    dec_lengths = shortened(batch, target_len, generator)
    targets = finish(text_with_sentinels(target_len, 4), dec_lengths, -100)
    dec_ids = torch.cat([torch.full((batch, 1), pad), targets[:, :-1]], 1)
    dec_ids = torch.where(dec_ids == -100, torch.full_like(dec_ids, pad), dec_ids)
    return enc_ids, enc_lengths, dec_ids, dec_lengths, targets

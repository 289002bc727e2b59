"""The BERT of `octet bench train`'s peer (bench/peers/torch_train.py runs it), eager PyTorch 1.13.

As octet's BERT (src/models/bert.cpp, post-LN as the original): word, position and token-type
embeddings summed and normalized; encoder layers h = LN1(x + attention(x)), out = LN2(h + MLP(h))
with one fused QKV linear, the padding mask from the sequences' lengths and a GELU MLP; the
masked-language-model head over the masked rows only (dense, GELU, LayerNorm, the decoder tied
to the word embedding plus its own bias) and the next-sentence head (pooler dense and tanh over
[CLS], then two classes). The loss is the MLM mean cross-entropy plus the NSP mean. torch 1.13
has no fused attention: softmax(QK^T / sqrt(d) + mask)V is explicit. The residual stream stays
FP32 under autocast, as torch_gpt.py's: the embeddings are FP32, a BF16 sublayer output added to
it gives FP32, and a LayerNorm of FP32 gives FP32 (torch 1.13's CPU autocast runs LayerNorm as
its input comes and refuses a BF16 input with FP32 weights).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# activation -> F.gelu's approximate argument
ACTIVATIONS = {"gelu_erf": "none", "gelu": "tanh"}


def check_config(config):
    if config.get("model") != "bert":
        raise SystemExit(f"torch_bert.py: config model={config.get('model')!r} is not 'bert'")
    if not config.get("post_layernorm", True):
        raise SystemExit("torch_bert.py: config post_layernorm=false (pre-LN) is not supported "
                         "(expected true)")
    activation = config.get("activation", "gelu_erf")
    if activation not in ACTIVATIONS:
        raise SystemExit(f"torch_bert.py: config activation={activation!r} is not supported "
                         f"(expected one of {sorted(ACTIVATIONS)})")
    if config.get("dropout", 0.0) != 0.0:
        raise SystemExit(f"torch_bert.py: config dropout={config['dropout']!r} is not supported "
                         "(expected 0)")


class Layer(nn.Module):
    """One post-LN encoder layer; x [B,T,C], pad [B,1,1,T] bool (True: a padding key)."""

    def __init__(self, hidden, heads, ffn, eps, approximate):
        super().__init__()
        self.heads, self.approximate = heads, approximate
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.fc = nn.Linear(hidden, ffn)
        self.mlp_proj = nn.Linear(ffn, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)

    def attention(self, x, pad):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, d).transpose(1, 2) for y in (q, k, v))  # [B,H,T,D]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        probs = torch.softmax(scores.masked_fill(pad, float("-inf")), dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, c)
        return self.attn_proj(y)

    def forward(self, x, pad):
        h = self.ln_1(x + self.attention(x, pad))
        return self.ln_2(h + self.mlp_proj(F.gelu(self.fc(h), approximate=self.approximate)))


class Bert(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_config(config)
        hidden, vocab = config["hidden"], config["vocab_size"]
        ffn = config.get("ffn_hidden", 0) or 4 * hidden
        eps = config.get("layernorm_eps", 1e-12)
        std = config.get("init_std", 0.02)
        self.approximate = ACTIVATIONS[config.get("activation", "gelu_erf")]
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(config["max_seq_len"], hidden)
        self.token_type = nn.Embedding(config.get("type_vocab_size", 2), hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            Layer(hidden, config["num_heads"], ffn, eps, self.approximate)
            for _ in range(config["num_layers"]))
        self.mlm_dense = nn.Linear(hidden, hidden)
        self.mlm_norm = nn.LayerNorm(hidden, eps=eps)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))  # the decoder's; its weight is `word`
        self.pooler = nn.Linear(hidden, hidden)
        self.nsp = nn.Linear(hidden, 2)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, std)
            elif "norm" not in name and "ln_" not in name:
                nn.init.zeros_(p)

    def forward(self, ids, token_types, lengths, targets, nsp_labels):
        """ids, token_types, targets [B,T] int64 (targets -100 where not masked); lengths,
        nsp_labels [B] int64. Returns the MLM mean cross-entropy plus the NSP mean."""
        b, t = ids.shape
        positions = torch.arange(t)
        x = self.word(ids) + self.position(positions) + self.token_type(token_types)
        x = self.embedding_norm(x)
        pad = (positions[None, :] >= lengths[:, None]).view(b, 1, 1, t)
        for layer in self.layers:
            x = layer(x, pad)
        hidden = x.shape[-1]
        # MLM: the masked rows only.
        flat_targets = targets.reshape(-1)
        rows = (flat_targets != -100).nonzero().squeeze(1)
        transformed = F.gelu(self.mlm_dense(x.reshape(-1, hidden).index_select(0, rows)),
                             approximate=self.approximate)
        transformed = self.mlm_norm(transformed.float())  # LayerNorm reads FP32
        logits = F.linear(transformed, self.word.weight, self.mlm_bias)
        mlm = F.cross_entropy(logits.float(), flat_targets.index_select(0, rows))
        # NSP: the pooler over [CLS].
        pooled = torch.tanh(self.pooler(x[:, 0]))
        nsp = F.cross_entropy(self.nsp(pooled).float(), nsp_labels)
        return mlm + nsp


def mock_batch(config, batch, seq, generator):
    """Full-length sequences [CLS] A [SEP] B [SEP] (the first [SEP] at seq // 2, token type 1
    after it), text ids uniform, ~15% of the text positions masked (at least one per sequence;
    80% [MASK], else a random text id), NSP labels uniform: the tuple Bert.forward takes."""
    if seq < 5 or seq > config["max_seq_len"]:
        raise SystemExit(f"torch_bert.py: sequence length expected in [5, "
                         f"{config['max_seq_len']}], got {seq}")
    vocab = config["vocab_size"]
    text_vocab, cls, sep, mask = vocab - 4, vocab - 3, vocab - 2, vocab - 1
    split = seq // 2
    positions = torch.arange(seq)
    text = (positions > 0) & (positions != split) & (positions < seq - 1)
    ids = torch.randint(0, text_vocab, (batch, seq), generator=generator)
    ids[:, 0] = cls
    ids[:, split] = sep
    ids[:, seq - 1] = sep
    token_types = (positions > split).long().expand(batch, seq).clone()
    masked = (torch.rand(batch, seq, generator=generator) < 0.15) & text
    # A sequence without a masked position gets one at a random text position.
    text_positions = text.nonzero().squeeze(1)
    pick = text_positions[torch.randint(0, len(text_positions), (batch,), generator=generator)]
    empty = ~masked.any(1)
    masked[empty, pick[empty]] = True
    targets = torch.where(masked, ids, torch.full_like(ids, -100))
    replace = torch.where(torch.rand(batch, seq, generator=generator) < 0.8,
                          torch.full_like(ids, mask),
                          torch.randint(0, text_vocab, (batch, seq), generator=generator))
    ids = torch.where(masked, replace, ids)
    lengths = torch.full((batch,), seq, dtype=torch.long)
    nsp_labels = torch.randint(0, 2, (batch,), generator=generator)
    return ids, token_types, lengths, targets, nsp_labels

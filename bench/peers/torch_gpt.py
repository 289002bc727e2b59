#!/usr/bin/env python3
"""The GPT of `octet bench train`'s peer (bench/peers/torch_train.py runs it), in eager PyTorch 1.13.

The model is the one octet's configs describe: token + learned position embeddings, pre-norm
blocks (LayerNorm, fused QKV attention with a causal mask, GELU-tanh MLP, biases), a final
LayerNorm and the output layer tied to the token embedding. torch 1.13 has no fused attention:
softmax(QK^T)V is explicit. Also here: what the peers share (resident memory, the saved
activations of one forward, one step under torch.profiler by octet's categories, answers).
Run with Debian's /usr/bin/python3 (torch 1.13).
"""
import json
import math
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


class Expert(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.c_fc = nn.Linear(hidden, ffn)
        self.mlp_proj = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.mlp_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class MoE(nn.Module):
    """A mixture of experts routed as octet's MoELayer (and Megatron-Core's): softmax or sigmoid
    scores, top-k on the scores plus the expert bias, optional normalization and scaling, the
    switch auxiliary loss and the z-loss; each expert applied to its tokens (index_select /
    index_add_, the usual eager-PyTorch dispatch), plus a shared expert."""

    def __init__(self, hidden, config):
        super().__init__()
        e = config["num_experts"]
        ffn = config.get("moe_ffn_hidden", 0) or config.get("ffn_hidden", 0) or 4 * hidden
        self.k = config.get("moe_router_topk", 2)
        self.sigmoid = config.get("moe_router_score_function", "softmax") == "sigmoid"
        self.normalize = config.get("moe_router_normalize", False)
        self.scaling = config.get("moe_router_topk_scaling_factor", 1.0)
        self.aux = config.get("moe_aux_loss_coeff", 0.0)
        self.z = config.get("moe_z_loss_coeff", 0.0)
        self.router = nn.Linear(hidden, e, bias=False)
        self.register_buffer("expert_bias", torch.zeros(e), persistent=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(e))
        shared = config.get("moe_shared_expert_ffn_hidden", 0)
        self.shared = Expert(hidden, shared) if shared else None
        self.loss = None  # the auxiliary losses of the last forward

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        chosen = torch.topk(scores.detach() + self.expert_bias, self.k, dim=-1).indices
        probs = scores.gather(1, chosen)
        if self.normalize:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        probs = probs * self.scaling
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(x.index_select(0, token))
            out.index_add_(0, token, (y * probs[token, slot].unsqueeze(-1)).to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        n, e = scores.shape
        self.loss = logits.new_zeros(())
        if self.aux > 0:
            counts = torch.bincount(chosen.flatten(), minlength=e).float()
            weights = scores / (scores.sum(-1, keepdim=True) + 1e-20) if self.sigmoid else scores
            self.loss = self.loss + self.aux * e / (self.k * n * n) * (weights.sum(0) * counts).sum()
        if self.z > 0:
            self.loss = self.loss + self.z * (torch.logsumexp(logits, -1) ** 2).mean()
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, hidden, heads, ffn, eps, config=None):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.moe = MoE(hidden, config) if config and config.get("num_experts", 0) else None
        if self.moe is None:
            self.c_fc = nn.Linear(hidden, ffn)
            self.mlp_proj = nn.Linear(ffn, hidden)

    def attention(self, x, mask):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, d).transpose(1, 2) for y in (q, k, v))  # [B,H,T,D]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        if mask is not None:  # causal (GPT); a ViT's patches see each other
            scores = scores.masked_fill(mask[:t, :t], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, c)
        return self.attn_proj(y)

    def forward(self, x, mask):
        x = x + self.attention(self.ln_1(x), mask)
        if self.moe is not None:
            return x + self.moe(self.ln_2(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config["hidden"]
        ffn = config.get("ffn_hidden", 0) or 4 * hidden
        eps = config.get("layernorm_eps", 1e-5)
        std = config.get("init_std", 0.02)
        self.wte = nn.Embedding(config["vocab_size"], hidden)
        self.wpe = nn.Embedding(config["max_seq_len"], hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, config["num_heads"], ffn, eps, config)
            for _ in range(config["num_layers"]))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        t = config["max_seq_len"]
        self.register_buffer("mask", torch.ones(t, t, dtype=torch.bool).triu(1), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scaled = name.endswith("proj.weight")  # GPT-2: residual projections
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * len(self.blocks)) if scaled else std)
            elif "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, ids, targets):
        t = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(t))
        for block in self.blocks:
            x = block(x, self.mask)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        for block in self.blocks:  # mixture-of-experts layers add their auxiliary losses
            if block.moe is not None:
                loss = loss + block.moe.loss
        return loss


def check_config(config):
    unsupported = {"normalization": "layernorm", "position_embedding": "learned",
                   "activation": "gelu", "bias": True, "tied_embeddings": True}
    for key, expected in unsupported.items():
        if config.get(key, expected) != expected:
            raise SystemExit(f"torch_gpt.py: config {key}={config[key]!r} is not supported "
                             f"(expected {expected!r})")
    if config.get("num_gqa_groups", 0) not in (0, config["num_heads"]):
        raise SystemExit("torch_gpt.py: grouped-query attention is not supported")


def saved_activation_bytes(model, inputs, autocast):
    """Bytes of the distinct storages autograd keeps for backward in one forward."""
    params = {p.data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = model(*inputs)
    del loss
    return sum(seen.values())


# torch ops (self CPU time) by octet's profile categories; the rest of the step is "other".
CATEGORIES = {
    "GEMMs": ("aten::addmm", "aten::mm"),
    "attention": ("aten::bmm", "aten::_softmax", "aten::_softmax_backward_data",
                  "aten::masked_fill", "aten::masked_fill_"),
    "norms+activations": ("aten::native_layer_norm", "aten::native_layer_norm_backward",
                          "aten::gelu", "aten::gelu_backward", "aten::embedding_dense_backward",
                          "aten::index_select", "aten::embedding"),
    "cross-entropy": ("aten::_log_softmax", "aten::_log_softmax_backward_data",
                      "aten::nll_loss_forward", "aten::nll_loss_backward"),
}


def profile_step(step):
    """One training step under torch.profiler: ms per category and the step's wall ms."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step(optimizer_range=lambda: record_function("optimizer"))
        step_ms = (time.perf_counter() - start) * 1e3
    self_us = {}
    optimizer_us = 0.0
    for event in prof.key_averages():
        self_us[event.key] = self_us.get(event.key, 0.0) + event.self_cpu_time_total
        if event.key == "optimizer":
            optimizer_us += event.cpu_time_total
    categories = {name: sum(self_us.get(op, 0.0) for op in ops) / 1e3
                  for name, ops in CATEGORIES.items()}
    categories["optimizer"] = optimizer_us / 1e3
    return {"categories": categories, "step_ms": step_ms}


def answer(value):
    print(json.dumps(value), flush=True)


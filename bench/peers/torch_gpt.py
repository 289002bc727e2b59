#!/usr/bin/env python3
"""The peer of `octet bench train`: the same GPT trained in eager PyTorch 1.13 on mock tokens.

The model is the one octet's configs describe: token + learned position embeddings, pre-norm
blocks (LayerNorm, fused QKV attention with a causal mask, GELU-tanh MLP, biases), a final
LayerNorm and the output layer tied to the token embedding; AdamW (betas 0.9/0.95, weight
decay 0.1 on matrices only, foreach off as torch 1.13's CPU default) with global-norm clipping
at 1.0, as octet's trainer does. torch 1.13 has no fused attention: softmax(QK^T)V is explicit.

Each precision (fp32 eager, bf16 = torch.autocast("cpu", bfloat16) over FP32 weights) prints
one JSON line: {"impl": "torch_fp32"|"torch_bf16", "precision", "tokens_per_s", "step_ms"
and "cpu_ms" (medians over the timed steps of wall and process CPU time), "steps", "warmup", "loss", "saved_activation_bytes" (unique
storages autograd saved during one forward, parameters excluded), "peak_bytes" (the process's
resident-memory high-water mark above its resident memory before the model was built; run one
precision per process to make this figure that precision's), "threads"}.
Run it with Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import json
import math
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


class Block(nn.Module):
    def __init__(self, hidden, heads, ffn, eps):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.c_fc = nn.Linear(hidden, ffn)
        self.mlp_proj = nn.Linear(ffn, hidden)

    def attention(self, x, mask):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, d).transpose(1, 2) for y in (q, k, v))  # [B,H,T,D]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        probs = torch.softmax(scores.masked_fill(mask[:t, :t], float("-inf")), dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, c)
        return self.attn_proj(y)

    def forward(self, x, mask):
        x = x + self.attention(self.ln_1(x), mask)
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
            Block(hidden, config["num_heads"], ffn, eps) for _ in range(config["num_layers"]))
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
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def check_config(config):
    unsupported = {"normalization": "layernorm", "position_embedding": "learned",
                   "activation": "gelu", "bias": True, "tied_embeddings": True}
    for key, expected in unsupported.items():
        if config.get(key, expected) != expected:
            raise SystemExit(f"torch_gpt.py: config {key}={config[key]!r} is not supported "
                             f"(expected {expected!r})")
    if config.get("num_gqa_groups", 0) not in (0, config["num_heads"]):
        raise SystemExit("torch_gpt.py: grouped-query attention is not supported")


def saved_activation_bytes(model, ids, targets, autocast):
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
        loss = model(ids, targets)
    del loss
    return sum(seen.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="octet model config JSON")
    parser.add_argument("--precision", default="bf16", help="fp32 | bf16 (comma-separated)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=0, help="0 = the config's max_seq_len")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(args.config) as f:
        config = json.load(f)
    check_config(config)
    batch, seq = args.micro_batch_size, args.seq_length or config["max_seq_len"]
    for precision in args.precision.split(","):
        if precision not in ("fp32", "bf16"):
            raise SystemExit(f"torch_gpt.py: --precision expected fp32 or bf16, got {precision!r}")
        torch.manual_seed(args.seed)
        baseline = resident_bytes()
        model = GPT(config)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
        batches = [torch.randint(0, config["vocab_size"], (batch, seq + 1)) for _ in range(4)]

        def autocast():
            return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

        def step(index):
            tokens = batches[index % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return loss.item()

        for i in range(args.warmup):
            step(i)
        seconds, cpu_seconds, loss = [], [], float("nan")
        for i in range(args.steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = step(args.warmup + i)
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        tokens = batches[0]
        saved = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:], autocast)
        step_s = statistics.median(seconds)
        print(json.dumps({"impl": "torch_" + precision, "precision": precision,
                          "config": config.get("name", "gpt"), "micro_batch_size": batch,
                          "seq_length": seq, "tokens_per_s": batch * seq / step_s,
                          "step_ms": step_s * 1e3,
                          "cpu_ms": statistics.median(cpu_seconds) * 1e3, "steps": args.steps, "warmup": args.warmup,
                          "loss": loss, "saved_activation_bytes": saved, "peak_bytes": peak,
                          "threads": torch.get_num_threads()}), flush=True)
        del model, optimizer
    return 0


if __name__ == "__main__":
    sys.exit(main())

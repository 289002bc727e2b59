#!/usr/bin/env python3
"""The peer of `octet bench train`: the same GPT trained in eager PyTorch 1.13 on mock tokens.

The model is the one octet's configs describe: token + learned position embeddings, pre-norm
blocks (LayerNorm, fused QKV attention with a causal mask, GELU-tanh MLP, biases), a final
LayerNorm and the output layer tied to the token embedding; AdamW (betas 0.9/0.95, weight
decay 0.1 on matrices only, foreach off as torch 1.13's CPU default) with global-norm clipping
at 1.0, as octet's trainer does. torch 1.13 has no fused attention: softmax(QK^T)V is explicit.

One process per precision (fp32 eager, or bf16 = torch.autocast("cpu", bfloat16) over FP32
weights), kept running beside octet so that both take their steps in the same minute: after the
warm-up steps it prints {"ready": true, "impl": "torch_fp32"|"torch_bf16", ...}, then answers one
JSON line per request line on stdin:
  {"steps": N}      -> {"seconds": [...], "cpu_seconds": [...], "loss"}: N timed steps, wall
                       and process CPU time each;
  {"op": "report"}  -> {"peak_bytes": the process's resident-memory high-water mark above its
                       resident memory before the model was built, "saved_activation_bytes":
                       unique storages autograd saved during one forward, parameters excluded};
  {"op": "profile"} -> {"categories": {"GEMMs": ms, "attention": ms, ...}, "step_ms"}: one
                       step under torch.profiler, its ops' self CPU time by octet's categories.
Run it with Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import contextlib
import json
import math
import resource
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
    parser.add_argument("--precision", default="bf16", help="fp32 | bf16")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=0, help="0 = the config's max_seq_len")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before ready")
    parser.add_argument("--threads", type=int, default=0, help="0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(args.config) as f:
        config = json.load(f)
    check_config(config)
    batch, seq = args.micro_batch_size, args.seq_length or config["max_seq_len"]
    precision = args.precision
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

    taken = 0

    def step(optimizer_range=contextlib.nullcontext):
        nonlocal taken
        tokens = batches[taken % len(batches)]
        taken += 1
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        with optimizer_range():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    answer({"ready": True, "impl": "torch_" + precision, "micro_batch_size": batch,
            "seq_length": seq, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "report":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
            tokens = batches[0]
            saved = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:], autocast)
            answer({"peak_bytes": peak, "saved_activation_bytes": saved})
            continue
        if request.get("op") == "profile":
            answer(profile_step(step))
            continue
        seconds, cpu_seconds, loss = [], [], float("nan")
        for _ in range(int(request["steps"])):
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = step()
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
        answer({"seconds": seconds, "cpu_seconds": cpu_seconds,
                "loss": loss if math.isfinite(loss) else None})
    return 0


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


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The peer of `octet bench ops`: each operator written in eager PyTorch 1.13, forward and
backward through autograd, on the shapes octet times.

Cases are "op:T:hidden:dtype:repeats[:min_ms]": at least `repeats` timed runs, and more (up
to 50) until they add up to min_ms, the rule octet applies to its own timings. With --cases they are run in turn; without, one case
per line is read from stdin and answered at once (octet keeps this process open and runs each
case right beside its own, so both see the same machine load). Each answer is one JSON line:
{"op", "T", "hidden", "dtype", "fwd_ms", "bwd_ms", "ms", "repeats"}: medians over the timed
runs after warm-up; ms is the median of fwd + bwd per repeat. adamw has no backward (bwd_ms 0).
Run it with Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HEAD_DIM = 64
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def rand(*shape, dtype, grad=False):
    t = torch.randn(*shape).to(dtype)
    return t.requires_grad_(grad)


def causal_mask(t):
    return torch.ones(t, t, dtype=torch.bool).triu(1)  # True = masked


def gpt_mini_shapes(hidden, layers=6):
    """~10.6M parameters: six Transformer layers of width 384 (weights, biases, norms)."""
    shapes = []
    for _ in range(layers):
        shapes += [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                   (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,),
                   (hidden,), (hidden,), (hidden,), (hidden,)]
    return shapes + [(hidden,), (hidden,)]


def build(op, T, hidden, dtype, args):
    """Returns (leaves, forward) where forward() gives the output to call backward on."""
    n = args.tokens
    heads = max(1, hidden // HEAD_DIM)
    if op == "layernorm":
        x, w, b = rand(n, hidden, dtype=dtype, grad=True), rand(hidden, dtype=dtype, grad=True), \
            rand(hidden, dtype=dtype, grad=True)
        return [x, w, b], lambda: F.layer_norm(x, (hidden,), w, b, 1e-5)
    if op == "rmsnorm":  # torch 1.13 has no RMSNorm: the usual eager composition
        x, w = rand(n, hidden, dtype=dtype, grad=True), rand(hidden, dtype=dtype, grad=True)
        return [x, w], lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    if op == "bias_gelu":
        x, b = rand(n, 4 * hidden, dtype=dtype, grad=True), rand(4 * hidden, dtype=dtype, grad=True)
        return [x, b], lambda: F.gelu(x + b, approximate="tanh")
    if op == "swiglu":
        x = rand(n, 8 * hidden, dtype=dtype, grad=True)

        def swiglu():
            a, g = x.chunk(2, dim=-1)
            return F.silu(a) * g
        return [x], swiglu
    if op == "softmax":
        x = rand(n // T, heads, T, T, dtype=dtype, grad=True)
        mask, scale = causal_mask(T), 1.0 / math.sqrt(HEAD_DIM)
        return [x], lambda: torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)
    if op == "attention":  # explicit softmax(QK^T)V: torch 1.13 has no fused SDPA
        b = n // T
        q, k, v = (rand(b, T, heads, HEAD_DIM, dtype=dtype, grad=True) for _ in range(3))
        mask, scale = causal_mask(T), 1.0 / math.sqrt(HEAD_DIM)

        def attention():
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B,H,T,D]
            s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
            p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
            return torch.matmul(p, vh).transpose(1, 2)
        return [q, k, v], attention
    if op == "rope":  # rotate-half (GPT-NeoX) layout on q and k, cos/sin cached as HF does
        b = n // T
        q, k = (rand(b, T, heads, HEAD_DIM, dtype=dtype, grad=True) for _ in range(2))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        angles = torch.outer(torch.arange(T).float(), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

        def rotate_half(t):
            t1, t2 = t.chunk(2, dim=-1)
            return torch.cat((-t2, t1), dim=-1)

        def rope():
            return torch.cat((q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin), 1)
        return [q, k], rope
    if op == "bias_dropout_add":
        x, b = rand(n, hidden, dtype=dtype, grad=True), rand(hidden, dtype=dtype, grad=True)
        residual = rand(n, hidden, dtype=dtype, grad=True)
        return [x, b, residual], lambda: residual + F.dropout(x + b, p=0.1, training=True)
    if op == "cross_entropy":
        logits = rand(args.ce_rows, args.vocab, dtype=dtype, grad=True)
        targets = torch.randint(0, args.vocab, (args.ce_rows,))
        return [logits], lambda: F.cross_entropy(logits, targets)
    if op == "embedding":
        table = rand(args.vocab, hidden, dtype=dtype, grad=True)
        ids = torch.randint(0, args.vocab, (n,))
        return [table], lambda: F.embedding(ids, table)
    raise ValueError(f"unknown op '{op}'")


MAX_REPEATS = 50


def keep_going(rep, warmup, repeats, timed, min_ms):
    return rep < warmup + repeats or (sum(timed) * 1e3 < min_ms and len(timed) < MAX_REPEATS)


def time_autograd(op, T, hidden, dtype, repeats, min_ms, args):
    leaves, forward = build(op, T, hidden, dtype, args)
    out = forward()
    dout = torch.randn(out.shape).to(out.dtype) if out.dim() > 0 else None
    fwd, bwd, total = [], [], []
    rep = 0
    while keep_going(rep, args.warmup, repeats, total, min_ms):
        for leaf in leaves:
            leaf.grad = None
        start = time.perf_counter()
        out = forward()
        middle = time.perf_counter()
        out.backward(dout)
        end = time.perf_counter()
        if rep >= args.warmup:
            fwd.append(middle - start)
            bwd.append(end - middle)
            total.append(end - start)
        rep += 1
    return statistics.median(fwd), statistics.median(bwd), statistics.median(total), len(total)


def time_adamw(hidden, dtype, repeats, min_ms, args):
    """torch.optim.AdamW (foreach off, torch 1.13's CPU default) on F32 master weights and F32
    grads (torch needs grads of the param's dtype); for bf16 a BF16 model copy follows."""
    params = [torch.randn(s) for s in gpt_mini_shapes(hidden)]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-2
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    models = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params] \
        if dtype == torch.bfloat16 else []
    times = []
    rep = 0
    while keep_going(rep, args.warmup, repeats, times, min_ms):
        start = time.perf_counter()
        with torch.no_grad():
            optimizer.step()
            for model, p in zip(models, params):
                model.copy_(p)
        if rep >= args.warmup:
            times.append(time.perf_counter() - start)
        rep += 1
    return statistics.median(times), 0.0, statistics.median(times), len(times)


def run_case(text, args):
    fields = text.strip().split(":")
    op, T, hidden, dtype_name, repeats = fields[:5]
    T, hidden, repeats = int(T), int(hidden), int(repeats)
    min_ms = float(fields[5]) if len(fields) > 5 else 0.0
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    if op == "adamw":
        fwd, bwd, total, runs = time_adamw(hidden, dtype, repeats, min_ms, args)
    else:
        fwd, bwd, total, runs = time_autograd(op, T, hidden, dtype, repeats, min_ms, args)
    return {"op": op, "T": T, "hidden": hidden, "dtype": dtype_name, "fwd_ms": fwd * 1e3,
            "bwd_ms": bwd * 1e3, "ms": total * 1e3, "repeats": runs,
            "threads": torch.get_num_threads()}


def answer(text, args):
    try:
        result = run_case(text, args)
    except Exception as error:  # reported to octet, which prints the case without torch
        result = {"case": text.strip(), "error": f"{type(error).__name__}: {error}"}
    print(json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="op:T:hidden:dtype:repeats[:min_ms],... (else stdin)")
    parser.add_argument("--threads", type=int, default=0, help="0 keeps torch's default")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048, help="B*T")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--ce-rows", type=int, default=512)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.cases:
        for text in args.cases.split(","):
            answer(text, args)
    else:
        print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
        for text in sys.stdin:
            if text.strip():
                answer(text, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The peer of `octet bench infer`: the same GPT generating with its own KV cache in PyTorch 1.13.

The model is torch_gpt.py's, subclassed (token + learned positions, pre-norm blocks, GELU-tanh MLP, tied
output layer) with a per-layer key/value cache that each decode step extends by one position,
the way Hugging Face's GPT-2 `past_key_values` works. Weights are cast to the precision
(model.to(torch.bfloat16) for bf16, as a CPU user serving in BF16 would) and every call runs
under torch.inference_mode().

PyTorch at its best on the processor at hand: `--precision auto` and `--linear auto` time one
decode-shaped linear layer ([1, hidden] x [4 hidden, hidden]) in each precision with each
linear backend, aten's (F.linear) and oneDNN's (torch.utils.mkldnn.to_mkldnn, the documented CPU
inference conversion), and run the fastest. It matters where aten has no fast GEMM: Debian's
torch 1.13 is built without a BLAS (BLAS_INFO=generic), so F.linear in FP32, and in BF16
without AVX-512 (where oneDNN's BF16 path is not taken), runs a generic loop at about
2 GFLOP/s on a Zen 3 VM, while oneDNN's FP32 linear does 70; with AVX-512 BF16, aten's BF16
linear is oneDNN's already. The choice is printed in the ready line.

Protocol (so octet can alternate with it, round by round): after start-up it prints
{"ready": true, "threads": N, "precision": P, "linear": L}; then for each line on stdin, a JSON case
  {"op": "prefill", "batch": B, "prompt": P}            -> {"ms": time to prefill B x P tokens}
  {"op": "decode", "batch": B, "prompt": P, "steps": S}  -> {"ms": median ms per decode step
                                                            of B sequences after a P-token prefill}
it answers one JSON line. Run it with Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_gpt  # the same GPT, beside this file


class Block(torch_gpt.Block):
    """torch_gpt's block, its attention extended by the cached keys and values."""

    def forward(self, x, past):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, d).transpose(1, 2) for y in (q, k, v))  # [B,H,T,D]
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        s = k.shape[2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        if t > 1:  # new query i sees keys up to s - t + i
            mask = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        y = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x, (k, v)


class GPT(torch_gpt.GPT):
    """torch_gpt's model (same parameters and initialization) generating with a KV cache."""

    def __init__(self, config):
        super().__init__(config)
        hidden = config["hidden"]
        ffn = config.get("ffn_hidden", 0) or 4 * hidden
        eps = config.get("layernorm_eps", 1e-5)
        cached = nn.ModuleList(
            Block(hidden, config["num_heads"], ffn, eps) for _ in range(config["num_layers"]))
        cached.load_state_dict(self.blocks.state_dict())
        self.blocks = cached

    def forward(self, ids, past):
        offset = 0 if past is None else past[0][0].shape[2]
        x = self.wte(ids) + self.wpe(torch.arange(offset, offset + ids.shape[1]))
        cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i])
            cache.append(kv)
        x = self.ln_f(x[:, -1])  # the last position only
        head = getattr(self, "head", None)
        logits = head(x) if head is not None else F.linear(x, self.wte.weight)
        return logits.float(), cache

    def tie_head(self):
        """The output layer as a module (wte's weight) so that to_mkldnn converts it too."""
        self.head = nn.Linear(self.wte.weight.shape[1], self.wte.weight.shape[0], bias=False)
        self.head.weight = self.wte.weight
        return self


def as_mkldnn(module, dtype):
    """The module with its linear layers run by oneDNN (weights in its layout)."""
    from torch.utils import mkldnn
    return mkldnn.to_mkldnn(module, dtype) if dtype == torch.bfloat16 else mkldnn.to_mkldnn(module)


def linear_ms(precision, linear, hidden, repeats=20):
    """Median ms of one decode-shaped linear layer; None where the combination fails."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = nn.Linear(hidden, 4 * hidden).to(dtype)
    x = torch.randn(1, hidden).to(dtype)
    try:
        with torch.inference_mode():
            if linear == "mkldnn":
                layer = as_mkldnn(layer, dtype)
            layer(x)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                layer(x)
                times.append((time.perf_counter() - start) * 1e3)
    except RuntimeError:
        return None
    return statistics.median(times)


def choose(precision, linear, hidden):
    """The fastest (precision, linear) among those asked for ("auto": both); a single one asked
    for is still run once, so that one that cannot run here is refused before the model is built."""
    precisions = ["bf16", "fp32"] if precision == "auto" else [precision]
    linears = ["aten", "mkldnn"] if linear == "auto" else [linear]
    best = None
    for p in precisions:
        for l in linears:
            ms = linear_ms(p, l, hidden)
            if ms is not None and (best is None or ms < best[0]):
                best = (ms, p, l)
    if best is None:
        raise SystemExit(f"torch_infer: no linear backend of {linears} runs in {precisions}")
    return best[1], best[2]


def build(config, seed, precision, linear, tie_head=True):
    """The peer's model: seeded weights, the precision, the linear layers' backend."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    if tie_head:
        model = model.tie_head()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = model.to(dtype)
    return as_mkldnn(model, dtype) if linear == "mkldnn" else model


def self_check(config, seed):
    """Every (precision, linear) that runs here generates what FP32 aten does: logits of a
    prefill and of 3 cached decode steps within each precision's rounding. The benchmark's
    ratio is only fair if the peer's fastest form is still the same model."""
    ids = torch.randint(0, config["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))

    def run(model):
        with torch.inference_mode():
            logits, cache = model(ids, None)
            out = [logits]
            for _ in range(3):
                logits, cache = model(logits.argmax(-1, keepdim=True), cache)
                out.append(logits)
        return out

    reference = run(build(config, seed, "fp32", "aten", tie_head=False))  # F.linear over wte
    checked = []
    for precision, tolerance in (("fp32", 1e-4), ("bf16", 6e-2)):
        for linear in ("aten", "mkldnn"):
            try:
                got = run(build(config, seed, precision, linear))
            except RuntimeError as error:  # e.g. oneDNN's BF16 linear without AVX-512
                reason = [line for line in str(error).splitlines() if line.strip()][-1].strip()
                checked.append(f"{precision}/{linear}: does not run ({reason})")
                continue
            for step, (g, r) in enumerate(zip(got, reference)):
                error = ((g - r).abs().max() / r.abs().max()).item()
                if not error <= tolerance:
                    raise SystemExit(f"torch_infer: {precision}/{linear} logits off FP32 aten's by "
                                     f"{error:.2e} of their largest at step {step} (expected <= "
                                     f"{tolerance})")
            checked.append(f"{precision}/{linear}: ok")
    print("; ".join(checked))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="octet model config JSON")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--linear", default="auto", choices=["auto", "aten", "mkldnn"],
                        help="linear layers by aten (F.linear) or oneDNN (torch.utils.mkldnn)")
    parser.add_argument("--threads", type=int, default=0, help="0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--self-check", action="store_true",
                        help="check every precision and linear backend against FP32 aten, exit")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(args.config) as f:
        config = json.load(f)
    torch_gpt.check_config(config)
    if args.self_check:
        self_check(config, args.seed)
        return 0
    precision, linear = choose(args.precision, args.linear, config["hidden"])
    model = build(config, args.seed, precision, linear)
    vocab = config["vocab_size"]
    print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "precision": precision,
                      "linear": linear}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        batch, prompt = case["batch"], case["prompt"]
        ids = torch.randint(0, vocab, (batch, prompt))
        with torch.inference_mode():
            start = time.perf_counter()
            logits, cache = model(ids, None)
            prefill_ms = (time.perf_counter() - start) * 1e3
            if case["op"] == "prefill":
                print(json.dumps({"ms": prefill_ms}), flush=True)
                continue
            steps = []
            for _ in range(case["steps"]):
                start = time.perf_counter()
                logits, cache = model(logits.argmax(-1, keepdim=True), cache)
                steps.append((time.perf_counter() - start) * 1e3)
        print(json.dumps({"ms": statistics.median(steps)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The peer of `octet bench infer`: the same GPT generating with its own KV cache in PyTorch 1.13.

The model is torch_gpt.py's, subclassed (token + learned positions, pre-norm blocks, GELU-tanh MLP, tied
output layer) with a per-layer key/value cache that each decode step extends by one position,
the way Hugging Face's GPT-2 `past_key_values` works. Weights are cast to the precision
(model.to(torch.bfloat16) for bf16, as a CPU user serving in BF16 would) and every call runs
under torch.inference_mode().

Protocol (so octet can alternate with it, round by round): after start-up it prints
{"ready": true, "threads": N}; then for each line on stdin, a JSON case
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
        logits = F.linear(self.ln_f(x[:, -1]), self.wte.weight)  # the last position only
        return logits.float(), cache


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="octet model config JSON")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=0, help="0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(args.config) as f:
        config = json.load(f)
    torch_gpt.check_config(config)
    torch.manual_seed(args.seed)
    model = GPT(config).eval()
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    vocab = config["vocab_size"]
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
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

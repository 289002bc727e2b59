#!/usr/bin/env python3
"""The peer of `octet bench train`: the same model trained in eager PyTorch 1.13 on mock data.

The config's family decides the model: a GPT (torch_gpt.py) on mock tokens, a ViT
(torch_vit.py, a config with "model": "vit") on mock images, or a BERT (torch_bert.py, "model":
"bert") on mock masked sentence pairs (the MLM and NSP losses), or a T5 (torch_t5.py, "model":
"t5") on mock span-corruption batches (--seq-length encoder tokens, --target-length decoder
tokens; a step's tokens are its encoder tokens, as octet counts them). AdamW (betas 0.9/0.95, weight
decay 0.1 on matrices only, foreach off as torch 1.13's CPU default) with global-norm clipping
at 1.0, as octet's trainer does.

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

import torch_bert
import torch_gpt
import torch_t5
import torch_vit
from torch_gpt import answer, profile_step, resident_bytes, saved_activation_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="octet model config JSON")
    parser.add_argument("--precision", default="bf16", help="fp32 | bf16")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=0,
                        help="GPT, BERT, T5 (encoder): 0 = the config's max_seq_len (a ViT's "
                        "is its patches + 1)")
    parser.add_argument("--target-length", type=int, default=0,
                        help="T5: decoder tokens per sequence, 0 = the config's max_target_len")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before ready")
    parser.add_argument("--threads", type=int, default=0, help="0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(args.config) as f:
        config = json.load(f)
    family = config.get("model", "gpt")
    precision = args.precision
    if precision not in ("fp32", "bf16"):
        raise SystemExit(f"torch_train.py: --precision expected fp32 or bf16, got {precision!r}")
    torch.manual_seed(args.seed)
    baseline = resident_bytes()
    batch = args.micro_batch_size
    if family == "vit":
        model = torch_vit.ViT(config)
        seq = (config["image_size"] // config["patch_size"]) ** 2 + 1
        generator = torch.Generator().manual_seed(args.seed)
        batches = [torch_vit.mock_batch(config, batch, generator) for _ in range(4)]
    elif family == "bert":
        model = torch_bert.Bert(config)
        seq = args.seq_length or config["max_seq_len"]
        generator = torch.Generator().manual_seed(args.seed)
        batches = [torch_bert.mock_batch(config, batch, seq, generator) for _ in range(4)]
    elif family == "t5":
        model = torch_t5.T5(config)
        seq = args.seq_length or config["max_seq_len"]
        target_len = args.target_length or config["max_target_len"]
        generator = torch.Generator().manual_seed(args.seed)
        batches = [torch_t5.mock_batch(config, batch, seq, target_len, generator)
                   for _ in range(4)]
    else:
        torch_gpt.check_config(config)
        model = torch_gpt.GPT(config)
        seq = args.seq_length or config["max_seq_len"]
        tokens = [torch.randint(0, config["vocab_size"], (batch, seq + 1)) for _ in range(4)]
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), eps=1e-8)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    taken = 0

    def step(optimizer_range=contextlib.nullcontext):
        nonlocal taken
        inputs = batches[taken % len(batches)]
        taken += 1
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = model(*inputs)
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
            saved = saved_activation_bytes(model, batches[0], autocast)
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


if __name__ == "__main__":
    sys.exit(main())

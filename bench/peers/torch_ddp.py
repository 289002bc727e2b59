#!/usr/bin/env python3
"""The peer of `octet bench parallel`: the same GPT and global batch trained by PyTorch 1.13.

The model, optimizer and clipping are torch_gpt.py's (imported, not copied). Two layouts:
  single  one process with --ranks threads, accumulating global/micro micro-batches a step;
  ddp     --ranks processes of one thread each, torch.nn.parallel.DistributedDataParallel over
          gloo on loopback (its buckets all-reduce during backward; no_sync() on all but each
          step's last micro-batch), each running global/(micro*ranks) micro-batches a step.
Each layout prints one JSON line: {"impl": "torch_single"|"torch_ddp", "precision", "config",
"processes", "threads_per_process", "micro_batch_size", "seq_length", "global_batch_size",
"tokens_per_s" (global batch tokens / median step; a ddp step is the slowest rank's), "step_ms",
"steps", "warmup", "loss" (the last step's mean)}. Progress goes to stderr.
Run it with Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402  (the same model as `octet bench train`'s peer)


def make_optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), eps=1e-8)


def train(args, config, rank, ranks, model, sync_step):
    """Times args.warmup + args.steps steps; returns (step seconds list, last loss)."""
    seq = args.seq_length or config["max_seq_len"]
    accumulation = args.global_batch_size // (args.micro_batch_size * ranks)
    optimizer = make_optimizer(model)
    generator = torch.Generator().manual_seed(args.seed + rank)
    batches = [torch.randint(0, config["vocab_size"], (args.micro_batch_size, seq + 1),
                             generator=generator) for _ in range(4)]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    seconds, loss_value = [], float("nan")
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(accumulation):
            last = micro + 1 == accumulation
            no_sync = model.no_sync() if ranks > 1 and not last else contextlib.nullcontext()
            tokens = batches[(step * accumulation + micro) % len(batches)]
            with no_sync:
                with autocast:
                    loss = model(tokens[:, :-1], tokens[:, 1:]) / accumulation
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed, loss_value = sync_step(time.perf_counter() - start, total)
        if step >= args.warmup:
            seconds.append(elapsed)
        if rank == 0:
            print(f"torch_ddp.py: {ranks} rank(s), step {step + 1}/{args.warmup + args.steps}: "
                  f"{elapsed * 1e3:.0f} ms, loss {loss_value:.4f}", file=sys.stderr, flush=True)
    return seconds, loss_value


def report(args, config, impl, processes, threads, seconds, loss):
    step = statistics.median(seconds)
    seq = args.seq_length or config["max_seq_len"]
    print(json.dumps({"impl": impl, "precision": args.precision,
                      "config": config.get("name", "gpt"), "processes": processes,
                      "threads_per_process": threads, "micro_batch_size": args.micro_batch_size,
                      "seq_length": seq, "global_batch_size": args.global_batch_size,
                      "tokens_per_s": args.global_batch_size * seq / step, "step_ms": step * 1e3,
                      "steps": args.steps, "warmup": args.warmup, "loss": loss}), flush=True)


def ddp_worker(rank, args, config, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=args.ranks)
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    gpt = torch_gpt.GPT(config)
    # The causal mask is a bool buffer, which gloo cannot broadcast; it is equal everywhere.
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(gpt, ["mask"])
    model = DDP(gpt)

    def sync_step(elapsed, loss):
        # The step is as slow as the slowest rank; the loss is the mean over ranks.
        figures = torch.tensor([elapsed, loss], dtype=torch.float64)
        slowest = figures.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(figures, op=dist.ReduceOp.SUM)
        return slowest[0].item(), figures[1].item() / args.ranks

    seconds, loss = train(args, config, rank, args.ranks, model, sync_step)
    if rank == 0:
        report(args, config, "torch_ddp", args.ranks, 1, seconds, loss)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="octet model config JSON")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=0, help="0 = the config's max_seq_len")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--layouts", default="single,ddp", help="single and/or ddp")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout not in ("single", "ddp"):
            raise SystemExit(f"torch_ddp.py: --layouts expected single and/or ddp, got {layout!r}")
    if args.ranks < 1 or args.steps < 1 or args.warmup < 0 or args.micro_batch_size < 1:
        raise SystemExit("torch_ddp.py: --ranks, --steps and --micro-batch-size must be positive")
    if args.global_batch_size % (args.micro_batch_size * args.ranks) != 0:
        raise SystemExit(f"torch_ddp.py: --global-batch-size ({args.global_batch_size}) expected a "
                         f"multiple of --micro-batch-size ({args.micro_batch_size}) x --ranks "
                         f"({args.ranks})")
    with open(args.config) as f:
        config = json.load(f)
    torch_gpt.check_config(config)
    if "single" in layouts:
        torch.set_num_threads(args.ranks)
        torch.manual_seed(args.seed)
        seconds, loss = train(args, config, 0, 1, torch_gpt.GPT(config),
                              lambda elapsed, loss: (elapsed, loss))
        report(args, config, "torch_single", 1, args.ranks, seconds, loss)
    if "ddp" in layouts:
        with tempfile.TemporaryDirectory() as scratch:
            mp.spawn(ddp_worker, args=(args, config, os.path.join(scratch, "init")),
                     nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The peer of `octet bench gemm`: torch.matmul GFLOP/s on the same shapes, same threads.

Kept running beside octet, which times each shape in rounds (ours, then the peer's, or the
other way round): prints {"ready": true, "threads": N}, then for each line on stdin
{"m", "n", "k", "repeats"} answers one JSON line {"torch_f32": {...}, "torch_bf16": {...}},
each {"gflops", "median_ms", "repeats", "rows"} (octet passes the repeat count it uses itself,
so both sides time alike).
Run it with Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import json
import statistics
import sys
import time

import torch


def median_seconds(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="0 keeps torch's default")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--f32-max-gflop", type=float, default=0.0,
                        help="time only enough rows of M for this many GFLOP in f32 (torch's "
                             "f32 CPU matmul may be a slow generic BLAS); 0 = all rows")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    torch.manual_seed(0)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        m, n, k, repeats = (int(request[key]) for key in ("m", "n", "k", "repeats"))
        answer = {}
        for name in args.dtypes.split(","):
            dtype = dtypes[name]
            rows, warmup, runs = m, args.warmup, repeats
            limit = args.f32_max_gflop * 1e9
            if name == "f32" and limit > 0 and 2.0 * m * n * k > limit:
                rows = max(1, min(m, int(limit / (2.0 * n * k))))
                warmup, runs = 0, 1
            a = torch.randn(rows, k).to(dtype)
            b = torch.randn(k, n).to(dtype)
            with torch.no_grad():
                seconds = median_seconds(lambda: torch.matmul(a, b), warmup, runs)
            del a, b
            answer["torch_" + name] = {"gflops": 2.0 * rows * n * k / seconds / 1e9,
                                       "median_ms": seconds * 1e3, "repeats": runs,
                                       "rows": rows}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

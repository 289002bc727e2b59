#!/usr/bin/env python3
"""Two octet binaries on the same benchmark, alternating in rounds (old, new, old, new ...):
the median of the per-round tokens/s ratios new/old, with their spread, for each row that
`octet bench train --json` (per precision) and `octet bench parallel --json` (per layout)
print. A refactoring that loses no speed gives ratios within the spread of 1.00.

  bench/old_vs_new.py OLD_OCTET NEW_OCTET [--rounds 3] [--train-args ...] [--parallel-args ...]
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys


def rows(binary, command):
    out = subprocess.run([binary] + command, check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or "tokens_per_s" not in record:
            continue
        key = record.get("layout") or "%s %s" % (record.get("impl", "octet"),
                                                  record.get("precision", ""))
        found[key] = record["tokens_per_s"]
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-args", default="bench train --config gpt-mini --precision "
                        "bf16,fp8 --no-torch --json --steps 3 --warmup 1")
    parser.add_argument("--parallel-args", default="bench parallel --no-torch --json --iters 3 "
                        "--warmup 1")
    args = parser.parse_args()
    for name, command in (("bench train", args.train_args), ("bench parallel", args.parallel_args)):
        ratios = {}
        for round_index in range(args.rounds):
            old = rows(args.old, shlex.split(command))
            new = rows(args.new, shlex.split(command))
            for key in sorted(set(old) & set(new)):
                if old[key] > 0:
                    ratios.setdefault(key, []).append(new[key] / old[key])
            print("%s round %d: %s" % (name, round_index + 1, ", ".join(
                "%s %.0f/%.0f" % (k, new[k], old[k]) for k in sorted(set(old) & set(new)))),
                file=sys.stderr, flush=True)
        print("%s (%s): new/old tokens/s, median of %d alternating rounds [min, max]" %
              (name, command, args.rounds))
        for key, values in ratios.items():
            print("  %-40s %.3fx [%.3f, %.3f]" % (key, statistics.median(values), min(values),
                                                  max(values)))
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Compares two `octet train --dump-grads` directories tensor by tensor.

Each DIR/step-N holds safetensors files (one per pipeline stage) with, under whole-model names
whatever the layout: every parameter's summed, unclipped gradient of the step ("grad.NAME"),
the parameters after the update ("NAME"), the update itself ("update.NAME" = after - before)
and the FP8 states ("fp8.I.forward.scale" ...). A layout computes the same model as one
process; what may differ is the order of FP32 sums (data-parallel reductions, tensor-parallel
GEMMs split along K, pipeline stages). Each tensor counts on its own, so an error in a small
tensor (a norm's bias) is not hidden by the large ones, and a uniform scale of every gradient
(which AdamW's sign-like first update would hide from the losses) shows in the gradients:

  gradients, FP8 scales:  max |candidate - reference| <= rtol * max |reference|
  updates, parameters:    ||candidate - reference|| <= rtol * ||reference||   (L2)

Updates and parameters are held in L2 because AdamW moves an element by about
lr * m / (sqrt(v) + eps): where the true gradient is zero (the key projection's bias, which
softmax ignores) or within rounding of eps, m is noise and single elements may move
differently by a fraction of lr in any correct layout; a wrong learning rate, step count,
weight decay or shard moves them all.

Usage: compare_dumps.py REFERENCE CANDIDATE [--grad-rtol R] [--grad-norm max|l2]
       [--update-rtol R] [--param-rtol R] [--no-updates] [--fp8-rtol R] [--fp8-moved]
       [--perturb NAME:FACTOR]
--fp8-moved requires some FP8 scale to have left its initial 1.0 in both dumps (the scales
were really updated, so comparing them means something). --perturb multiplies one candidate
tensor by FACTOR before comparing: the check that this comparison can fail.
Exit status 0 when every tensor agrees; 1 with the worst offenders listed otherwise.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import safetensors_io  # noqa: E402  (the tests' own reader, numpy only here)


def load_safetensors(path):
    return {name: array.astype(np.float64)
            for name, array in safetensors_io.load_numpy(path).items()}


def relative_error(got, want, norm):
    """max |got - want| / max |want| (norm "max") or ||got - want|| / ||want|| (norm "l2")."""
    if want.size == 0:
        return 0.0
    if norm == "max":
        diff, scale = np.max(np.abs(got - want)), np.max(np.abs(want))
    else:
        diff, scale = np.linalg.norm(got - want), np.linalg.norm(want)
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return float(diff / scale)


def load_step(directory):
    """Merges a step's shards; a tensor held by two stages (the tied embedding) must agree."""
    tensors, problems = {}, []
    for file in sorted(os.listdir(directory)):
        if not file.endswith(".safetensors"):
            continue
        for name, array in load_safetensors(os.path.join(directory, file)).items():
            if name in tensors:
                if tensors[name].shape != array.shape or relative_error(array, tensors[name], "max") > 0:
                    problems.append(f"{directory}: the copies of {name} on two stages differ")
                continue
            tensors[name] = array
    return tensors, problems


def steps_of(root):
    steps = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    if not steps:
        raise SystemExit(f"compare_dumps: no step-N directories in {root}")
    return steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("reference")
    parser.add_argument("candidate")
    parser.add_argument("--grad-rtol", type=float, default=1e-5)
    parser.add_argument("--grad-norm", choices=("max", "l2"), default="max")
    parser.add_argument("--no-updates", action="store_true",
                        help="compare gradients and FP8 scales only (FP8 in BF16 compute: AdamW's "
                        "first updates are sign-like, so FP8 rounding noise flips them)")
    parser.add_argument("--update-rtol", type=float, default=1e-5)
    parser.add_argument("--param-rtol", type=float, default=1e-5)
    parser.add_argument("--fp8-rtol", type=float, default=0.0)
    parser.add_argument("--fp8-moved", action="store_true")
    parser.add_argument("--perturb", default="")
    args = parser.parse_args()

    failures = []
    kinds = ("grad", "update", "param", "fp8 scale")
    worst = {kind: (0.0, "") for kind in kinds}
    counted = {kind: 0 for kind in kinds}
    reference_steps, candidate_steps = steps_of(args.reference), steps_of(args.candidate)
    if reference_steps != candidate_steps:
        failures.append(f"steps differ: {candidate_steps} (expected {reference_steps})")
    moved = {"reference": False, "candidate": False}
    for step in reference_steps:
        if step not in candidate_steps:
            continue
        want, problems_want = load_step(os.path.join(args.reference, step))
        got, problems_got = load_step(os.path.join(args.candidate, step))
        failures += problems_want + problems_got
        if args.perturb:
            name, factor = args.perturb.rsplit(":", 1)
            if name not in got:
                raise SystemExit(f"compare_dumps: --perturb names no tensor '{name}'")
            got[name] = got[name] * float(factor)
        if sorted(want) != sorted(got):
            missing = sorted(set(want) - set(got))[:5]
            extra = sorted(set(got) - set(want))[:5]
            failures.append(f"{step}: tensor names differ (missing {missing}, extra {extra})")
        for name in sorted(set(want) & set(got)):
            norm = "max"
            if name.startswith("fp8."):
                # Scales only: the amax history's rows and the call counts follow how many
                # micro-batches a rank ran, which data parallelism changes.
                if not name.endswith(".scale") and not name.endswith(".scale_inv"):
                    continue
                kind, rtol = "fp8 scale", args.fp8_rtol
                if name.endswith(".scale"):
                    moved["reference"] |= bool(np.any(want[name] != 1.0))
                    moved["candidate"] |= bool(np.any(got[name] != 1.0))
            elif name.startswith("grad."):
                kind, rtol, norm = "grad", args.grad_rtol, args.grad_norm
            elif args.no_updates:
                continue
            elif name.startswith("update."):
                kind, rtol, norm = "update", args.update_rtol, "l2"
            else:
                kind, rtol, norm = "param", args.param_rtol, "l2"
            if got[name].shape != want[name].shape:
                failures.append(f"{step} {name}: shape {got[name].shape}, expected {want[name].shape}")
                continue
            error = relative_error(got[name], want[name], norm)
            counted[kind] += 1
            if error > worst[kind][0] or not worst[kind][1]:
                worst[kind] = (error, f"{step} {name}")
            if not error <= rtol:
                failures.append(f"{step} {name}: relative error ({norm}) {error:.3g} > {rtol:g}")
    if args.fp8_moved and not (moved["reference"] and moved["candidate"]):
        failures.append(f"FP8 scales never left 1.0 (moved: {moved}): nothing was compared")
    summary = ", ".join(
        f"{kind} {worst[kind][0]:.2g} ({worst[kind][1]})" for kind in worst if counted[kind])
    counts = ", ".join(f"{counted[kind]} {kind}" for kind in counted if counted[kind])
    print(f"worst relative error: {summary}; compared {counts}")
    if failures:
        for line in failures[:10]:
            print("  " + line)
        if len(failures) > 10:
            print(f"  ... and {len(failures) - 10} more")
        sys.exit(1)


if __name__ == "__main__":
    main()

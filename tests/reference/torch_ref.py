"""PyTorch 1.13 reference for octet's tests: `torch_ref.py OP INPUTS OUTPUTS ARGS_JSON`.

Reads the inputs (safetensors), computes OP's forward (and backward where the op has one)
in float64 unless the op says otherwise, and writes the results (safetensors, float32).
"""
import glob
import importlib
import json
import os
import sys

import torch

import safetensors_io
from registry import OPS, op


@op("echo")
def echo(t, args):
    """Round trip check: returns every input doubled, in float32."""
    return {name: (value.double() * 2).float() for name, value in t.items()}


@op("matmul")
def matmul(t, args):
    a, b = t["a"].double(), t["b"].double()
    return {"c": (a @ b).float()}


def load_families():
    """Each operator family keeps its references in ops_<family>.py beside this file."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "ops_*.py"))):
        importlib.import_module(os.path.basename(path)[:-3])


def main():
    load_families()
    name, inputs_path, outputs_path, args_text = sys.argv[1:5]
    torch.manual_seed(0)
    inputs = safetensors_io.load(inputs_path)
    outputs = OPS[name](inputs, json.loads(args_text))
    safetensors_io.save(outputs_path, {k: v.detach().float().contiguous() for k, v in outputs.items()})


if __name__ == "__main__":
    main()

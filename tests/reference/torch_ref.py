"""PyTorch 1.13 reference for octet's tests: `torch_ref.py OP INPUTS OUTPUTS ARGS_JSON`.

Reads the inputs (safetensors), computes OP's forward (and backward where the op has one)
in float64 unless the op says otherwise, and writes the results (safetensors, float32).

`torch_ref.py --serve SOCKET` imports torch and the references once and answers requests on
a Unix socket instead (scripts/test.sh: one import for the whole test pass, not one per test):
each request is one line, the JSON list [OP, INPUTS, OUTPUTS, ARGS_JSON], computed in a
forked child exactly as the command line computes it; the answer is one line, "ok" or
"error" and the traceback on one line.
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


def compute(name, inputs_path, outputs_path, args_text):
    torch.manual_seed(0)
    inputs = safetensors_io.load(inputs_path)
    outputs = OPS[name](inputs, json.loads(args_text))
    safetensors_io.save(outputs_path, {k: v.detach().float().contiguous() for k, v in outputs.items()})


def serve(path):
    import socketserver
    import traceback

    class Request(socketserver.StreamRequestHandler):
        def handle(self):
            try:
                compute(*json.loads(self.rfile.readline()))
                answer = "ok"
            except Exception:  # the test reports it: the server goes on
                answer = "error " + traceback.format_exc().replace("\n", " | ")
            self.wfile.write((answer + "\n").encode())

    class Server(socketserver.ForkingMixIn, socketserver.UnixStreamServer):
        pass

    with Server(path, Request) as server:
        server.serve_forever()


def main():
    load_families()
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
        return
    compute(*sys.argv[1:5])


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The main job: install what is missing, build, and show the engine at work.
# (Until training lands, that is the FP8 + GEMM demo and the GEMM benchmark.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh build
./build/octet info
./build/octet demo
./build/octet bench gemm

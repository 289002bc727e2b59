#!/usr/bin/env bash
# Configures and builds octet. Usage: scripts/build.sh [build-dir] [extra cmake args...]
# TARGET=octet_cli builds only the command (the main job needs no test binaries); TARGET may
# name several, separated by spaces.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${1:-build}"
shift || true
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
if [ -n "${TARGET:-}" ]; then
  # shellcheck disable=SC2086  # a list of targets
  cmake --build "$build_dir" -j "$(nproc)" --target $TARGET
else
  cmake --build "$build_dir" -j "$(nproc)"
fi

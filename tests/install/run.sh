#!/usr/bin/env bash
# Installs the build tree BUILD into a temporary prefix, builds tests/install against it with
# find_package(octet), runs the program and `octet train --config gpt-tiny` from the prefix
# (the config found by name among the installed ones). Usage: run.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/lib/cmake/octet/octetConfig.cmake"
test -f "$work/prefix/include/octet/modules.h"
test -f "$work/prefix/share/octet/configs/gpt-tiny.json"
cmake -S "$here" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/consumer/consumer"
# The installed binary finds configs by name beside it (a name only the prefix holds).
cp "$work/prefix/share/octet/configs/gpt-tiny.json" "$work/prefix/share/octet/configs/installed-only.json"
"$work/prefix/bin/octet" train --config installed-only --mock-data --train-iters 1 \
  --micro-batch-size 1 --seq-length 16 --precision fp32 --peak-gflops 1 >/dev/null
echo "installed octet train --config installed-only: ok"
if "$work/prefix/bin/octet" train --config no-such-model --mock-data 2>"$work/err"; then
  echo "expected --config no-such-model to fail"; exit 1
fi
grep -q "gpt-tiny" "$work/err" || { echo "the error should list the configs:"; cat "$work/err"; exit 1; }

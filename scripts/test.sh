#!/usr/bin/env bash
# The tests: install what is missing, build with warnings as errors, run every suite, then
# build again with AddressSanitizer + UndefinedBehaviorSanitizer and run the unit tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch_data.sh  # the tokenizer tests compare against the pinned reference encoder

bash scripts/build.sh build
(cd build && ctest --output-on-failure -j 2)

bash scripts/build.sh build-sanitize -DOCTET_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
# oneDNN's JIT and libgomp keep allocations alive for the process lifetime: leaks are not
# findings here; every other ASan/UBSan report fails the run.
(cd build-sanitize && ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --output-on-failure -j 2)

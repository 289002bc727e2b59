#!/usr/bin/env bash
# Fuzzes octet's readers with libFuzzer under AddressSanitizer + UndefinedBehaviorSanitizer.
#   scripts/fuzz.sh [seconds-per-target] [targets...]     (default: 60 s, every target)
# Targets (tests/fuzz/fuzz_<target>.cpp): safetensors checkpoint token_shard model_config
# tokenizer idx. Builds build-fuzz with clang, replays each target's kept crash inputs
# (tests/fuzz/regressions/<target>/, each must now pass), then fuzzes a copy of its seed corpus
# (tests/fuzz/corpus/<target>/) on one process for the given time. Prints per target the
# executions, exec/s, corpus size and crashes; exits 1 on any crash, keeping the input under
# build-fuzz/runs/<target>/findings/ (add it to regressions/ once fixed).
# The tokenizer target needs data/ (scripts/fetch_data.sh). Extra libFuzzer flags: FUZZ_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(safetensors checkpoint token_shard model_config tokenizer idx)
fi

build_start=$SECONDS
# -O1 with line tables: quick to compile, and sanitizer reports still name lines. Assertions
# stay on (no NDEBUG): a failed one is a finding. Not -Werror: clang 14 warns where gcc does not
# (the gcc build in scripts/build.sh holds the warnings-as-errors line).
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" -DOCTET_FUZZ=ON -DOCTET_WERROR=OFF \
  -DOCTET_BUILD_TESTS=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target "${targets[@]/#/fuzz_}"
echo "fuzz: build took $((SECONDS - build_start)) s"

# Leaks are findings too; halt on the first UBSan report so that it is a crash with an input.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

stat_of() {  # stat_of NAME LOG: a -print_final_stats=1 figure
  sed -n "s/^stat::$1: *//p" "$2" | tail -1
}

summary=()
failed=0
for target in "${targets[@]}"; do
  binary="build-fuzz/tests/fuzz/fuzz_$target"
  run="build-fuzz/runs/$target"
  rm -rf "$run"
  mkdir -p "$run/corpus" "$run/findings"
  cp tests/fuzz/corpus/"$target"/* "$run/corpus/"
  regressions="tests/fuzz/regressions/$target"
  crashes=0
  if compgen -G "$regressions/*" >/dev/null; then
    # Each kept crash input once: it must run clean now.
    if ! "$binary" -artifact_prefix="$run/findings/" "$regressions"/* >"$run/regressions.log" 2>&1
    then
      echo "fuzz: $target: a kept regression input fails again:"
      tail -30 "$run/regressions.log"
      crashes=1
    else
      cp "$regressions"/* "$run/corpus/"  # passing now: seeds too
    fi
  fi
  dict=()
  if [ -f "tests/fuzz/$target.dict" ]; then dict=(-dict="tests/fuzz/$target.dict"); fi
  # One process: the machine's other core stays free. A 25 s input is a hang (a finding).
  set +e
  # shellcheck disable=SC2086  # FUZZ_FLAGS is a list of flags
  "$binary" "$run/corpus" "${dict[@]}" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$run/findings/" ${FUZZ_FLAGS:-} >"$run/fuzz.log" 2>&1
  status=$?
  set -e
  findings=$(find "$run/findings" -type f | wc -l)
  if ((status != 0 || findings > 0)); then
    echo "fuzz: $target: crash (exit $status); input kept in $run/findings/:"
    ls "$run/findings"
    grep -m1 -A20 -E "ERROR: |runtime error|==ERROR|deadly signal|Timeout|out-of-memory" \
      "$run/fuzz.log" || tail -30 "$run/fuzz.log"
    crashes=$((crashes + (findings > 0 ? findings : 1)))
  fi
  ((crashes == 0)) || failed=1
  executions=$(stat_of number_of_executed_units "$run/fuzz.log")
  rate=$(stat_of average_exec_per_sec "$run/fuzz.log")
  corpus=$(find "$run/corpus" -type f | wc -l)
  summary+=("$(printf '%-13s %12s executions %8s exec/s %6s corpus files %3s crashes  (%s s)' \
    "$target" "${executions:-?}" "${rate:-?}" "$corpus" "$crashes" "$seconds")")
done

echo "fuzz summary (libFuzzer, ASan + UBSan, one process per target):"
printf '  %s\n' "${summary[@]}"
exit "$failed"

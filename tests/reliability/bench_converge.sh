#!/usr/bin/env bash
# `octet bench converge` end to end on a tiny model: the report (table, JSON, SVG) has a row
# per variant; a second invocation reuses finished variants and adds new ones to the report;
# a variant stopped by SIGTERM resumes from its checkpoint and its curve has every step once;
# other settings retrain instead of reusing.
# Usage: bench_converge.sh OCTET_BINARY
set -euo pipefail
octet="$1"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
common=(bench converge --config gpt-tiny --mock-data --micro-batch-size 2 --seq-length 32
  --eval-interval 5 --peak-gflops 100 --out "$dir/cv")
fail() {
  echo "FAIL: $*"
  exit 1
}

"$octet" "${common[@]}" --variants bf16,fp8-dpa --train-iters 10 >"$dir/first.log" 2>&1 ||
  fail "first run: $(tail -n 5 "$dir/first.log")"
for variant in bf16 fp8-dpa; do
  grep -q "^| $variant | 10 | " "$dir/cv/converge.md" || fail "no $variant row in converge.md"
done
grep -q "<svg" "$dir/cv/converge.svg" || fail "converge.svg is not an SVG"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert set(d['variants'])=={'bf16','fp8-dpa'}, d" \
  "$dir/cv/converge.json" || fail "converge.json"
echo "ok: first run, report with bf16 and fp8-dpa"

"$octet" "${common[@]}" --variants bf16,mxfp4 --train-iters 10 >"$dir/second.log" 2>&1 ||
  fail "second run: $(tail -n 5 "$dir/second.log")"
grep -q "bf16: reusing" "$dir/second.log" || fail "bf16 was not reused"
for variant in bf16 fp8-dpa mxfp4; do
  grep -q "^| $variant | 10 | " "$dir/cv/converge.md" || fail "no $variant row after the second run"
done
echo "ok: second run reused bf16 and appended mxfp4"

# Stop fp8-current with SIGTERM after its first checkpoint (step 5), then resume it.
"$octet" "${common[@]}" --variants fp8-current --train-iters 60 >"$dir/stopped.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  [ -d "$dir/cv/fp8-current/checkpoint" ] && break
  sleep 0.1
done
[ -d "$dir/cv/fp8-current/checkpoint" ] || fail "no checkpoint appeared"
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
[ "$status" -ne 0 ] || fail "the stopped run exited 0"
grep -q "run the same command again to resume" "$dir/stopped.log" || fail "no resume hint"
"$octet" "${common[@]}" --variants fp8-current --train-iters 60 >"$dir/resumed.log" 2>&1 ||
  fail "resume: $(tail -n 5 "$dir/resumed.log")"
grep -q "fp8-current: resuming" "$dir/resumed.log" || fail "did not resume"
python3 - "$dir/cv/fp8-current/result.json" <<'PY' || fail "resumed curve"
import json, sys
r = json.load(open(sys.argv[1]))
steps = [p[0] for p in r["train_curve"]]
assert steps == list(range(1, 61)), (len(steps), steps[:3], steps[-3:])
PY
[ ! -d "$dir/cv/fp8-current/checkpoint" ] || fail "the finished variant kept its checkpoint"
echo "ok: stopped run resumed from its checkpoint, every step once"

"$octet" "${common[@]}" --variants bf16 --train-iters 4 >"$dir/other.log" 2>&1 ||
  fail "other settings: $(tail -n 5 "$dir/other.log")"
grep -q "bf16: .* other settings; training again" "$dir/other.log" || fail "bf16 reused across settings"
grep -q "^| bf16 | 4 | " "$dir/cv/converge.md" || fail "bf16 row not retrained"
grep -q "^| fp8-dpa" "$dir/cv/converge.md" && fail "a variant of other settings joined the report"
echo "ok: other settings retrain"

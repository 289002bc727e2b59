#!/usr/bin/env bash
# Graceful stop (Megatron's --exit-signal-handler): SIGTERM mid-run finishes the step, saves,
# exits with status 75 and resumes; a second signal ends the process at once; under mpirun a
# signal to one rank stops every rank after the same step, and rank 0 (never signalled)
# writes the checkpoint of that step.
# Usage: signals.sh OCTET_BINARY
set -euo pipefail
octet="$1"
dir="$(mktemp -d)"
trap 'pkill -KILL -f -- "$dir" 2>/dev/null || true; rm -rf "$dir"' EXIT
train=(train --config gpt-tiny --mock-data --train-iters 100000 --log-interval 1 --eval-iters 0
  --peak-gflops 100 --micro-batch-size 2 --seq-length 32)
source "$(dirname "$0")/common.sh"
iteration() { /usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["iteration"])' "$1/trainer.json"; }

# 1. One process: SIGTERM after 3 steps.
"$octet" "${train[@]}" --save "$dir/one" --metrics "$dir/one.jsonl" >"$dir/one.log" 2>&1 &
pid=$!
wait_lines "$dir/one.jsonl" 3 "$pid"
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
[ "$status" -eq 75 ] || { cat "$dir/one.log"; fail "exit status $status after SIGTERM, expected 75"; }
steps="$(lines "$dir/one.jsonl")"
[ "$(iteration "$dir/one")" -eq "$steps" ] || fail "checkpoint of step $(iteration "$dir/one"), the run did $steps"
grep -q "SIGTERM: stopped after step $steps of 100000; checkpoint in $dir/one" "$dir/one.log" ||
  { cat "$dir/one.log"; fail "no stop message"; }
echo "ok: SIGTERM after step $steps: checkpoint of step $steps, exit status 75"
# It resumes from there.
"$octet" "${train[@]/100000/$((steps + 2))}" --load "$dir/one" --save "$dir/one" >"$dir/resume.log" 2>&1 ||
  { cat "$dir/resume.log"; fail "resume failed"; }
[ "$(iteration "$dir/one")" -eq $((steps + 2)) ] || fail "resume did not reach step $((steps + 2))"
echo "ok: resumed to step $((steps + 2))"

# 2. A second signal does not wait for the step.
"$octet" "${train[@]/32/64}" --global-batch-size 64 --save "$dir/two" --metrics "$dir/two.jsonl" >"$dir/two.log" 2>&1 &
pid=$!
wait_lines "$dir/two.jsonl" 1 "$pid"
kill -INT "$pid"
sleep 0.1  # two pending signals of one kind merge into one
kill -INT "$pid"
status=0
wait "$pid" || status=$?
[ "$status" -eq 130 ] || { cat "$dir/two.log"; fail "exit status $status after two SIGINTs, expected 130 (killed by SIGINT)"; }
echo "ok: a second SIGINT ends the process at once (status $status)"

# 3. Two data-parallel ranks: SIGTERM to rank 1 only.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
mpirun -np 2 --oversubscribe "$octet" "${train[@]}" --global-batch-size 4 --save "$dir/mpi" \
  --metrics "$dir/mpi.jsonl" >"$dir/mpi.log" 2>&1 &
launcher=$!
wait_lines "$dir/mpi.jsonl" 3 "$launcher"
kill -TERM "$(rank_pid "$dir/mpi.jsonl" 1)"
status=0
wait "$launcher" || status=$?
[ "$status" -eq 75 ] || { cat "$dir/mpi.log"; fail "mpirun exit status $status, expected 75"; }
steps="$(lines "$dir/mpi.jsonl")"
[ "$(iteration "$dir/mpi")" -eq "$steps" ] || fail "checkpoint of step $(iteration "$dir/mpi"), rank 0 logged $steps"
echo "ok: SIGTERM to one of 2 ranks: both stopped after step $steps, rank 0 saved it, exit status 75"

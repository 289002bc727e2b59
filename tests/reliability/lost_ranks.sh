#!/usr/bin/env bash
# Lost and stuck ranks under mpirun, each mid-run of octet train:
#   1. a killed rank (SIGKILL) ends every rank, with the launcher's message naming it;
#   2. a stopped rank (SIGSTOP) in a data-parallel run: the other rank's wait times out after
#      --comm-timeout, names the collective and the rank that does not answer the roll call,
#      and the job ends (MPI_Abort) instead of hanging;
#   3. the same in a pipeline: the first stage's receive names the stopped stage.
# Prints how long each took from the signal to the end of the job.
# Usage: lost_ranks.sh OCTET_BINARY
set -euo pipefail
octet="$1"
dir="$(mktemp -d)"
trap 'pkill -KILL -f -- "$dir" 2>/dev/null || true; rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
train=(train --config gpt-tiny --mock-data --train-iters 100000 --log-interval 1 --eval-iters 0
  --peak-gflops 100 --micro-batch-size 2 --seq-length 32 --global-batch-size 4)
timeout_s=5
source "$(dirname "$0")/common.sh"
# LAUNCHER LIMIT: waits for mpirun to end (LIMIT seconds at most); sets status.
wait_job() {
  for _ in $(seq $(($2 * 10))); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$1" 2>/dev/null && fail "the job still runs $2 s after the signal (hung)"
  status=0
  wait "$1" || status=$?
}
now_ms() { date +%s%3N; }

# 1. SIGKILL to rank 1 of two data-parallel ranks.
mpirun -np 2 --oversubscribe "$octet" "${train[@]}" --metrics "$dir/kill.jsonl" >"$dir/kill.log" 2>&1 &
launcher=$!
wait_lines "$dir/kill.jsonl" 3 "$launcher"
victim="$(rank_pid "$dir/kill.jsonl" 1)"
t0=$(now_ms)
kill -KILL "$victim"
wait_job "$launcher" 60
ms=$(($(now_ms) - t0))
[ "$status" -ne 0 ] || fail "mpirun exited 0 after a rank was killed"
# Open MPI 4.1 names the rank (its pid as 0 when the rank is killed during a collective).
grep -q "process rank 1 with PID [0-9]* on node .* exited on signal 9 (Killed)" "$dir/kill.log" ||
  { cat "$dir/kill.log"; fail "no message naming the killed rank 1 (pid $victim)"; }
echo "ok: SIGKILL to rank 1 (pid $victim): the job ended in $ms ms (exit status $status); the launcher names rank 1$(
  grep -m1 -o "octet: error on rank 0: .*" "$dir/kill.log" | cut -c1-160 | sed 's/^/; /')"

# NAME WHAT EXPECTED [FLAGS...]: a two-rank run with FLAGS; SIGSTOP to rank 1 after 3 steps;
# rank 0's error must match EXPECTED (a grep pattern, after "octet: error on rank 0: ").
stop_rank_1() {
  local name="$1" what="$2" expected="$3" launcher victim t0 ms
  shift 3
  mpirun -np 2 --oversubscribe "$octet" "${train[@]}" "$@" --comm-timeout "$timeout_s" \
    --metrics "$dir/$name.jsonl" >"$dir/$name.log" 2>&1 &
  launcher=$!
  wait_lines "$dir/$name.jsonl" 3 "$launcher"
  victim="$(rank_pid "$dir/$name.jsonl" 1)"
  t0=$(now_ms)
  kill -STOP "$victim"
  wait_job "$launcher" $((timeout_s + 60))
  ms=$(($(now_ms) - t0))
  [ "$status" -ne 0 ] || fail "mpirun exited 0 after $what was stopped"
  grep -q "octet: error on rank 0: $expected still pending after $timeout_s s (no answer to a roll call within [0-9.]* s from rank 1 (pid $victim on .*): stopped, hung or unreachable)" \
    "$dir/$name.log" || { cat "$dir/$name.log"; fail "rank 0 does not name $what (rank 1, pid $victim)"; }
  echo "ok: SIGSTOP to $what (rank 1, pid $victim): the job ended in $ms ms with --comm-timeout $timeout_s:"
  grep -m1 "octet: error on rank 0: " "$dir/$name.log" | sed 's/^/    /'
}

# Where rank 0 waits depends on when the signal lands: in the step's transfers, or in one of
# the all-reduces around them (the loss average, the gradient norm, tied embeddings' gradients,
# the agreement on a stop signal between steps).
all_reduce='[a-z_]*: all_reduce ([^)]*):'

# 2. SIGSTOP to rank 1 of two data-parallel ranks: the gradient all-reduce (or another all-reduce).
stop_rank_1 stop "a data-parallel rank" "$all_reduce"

# 3. SIGSTOP to the last of two pipeline stages: a receive from it (or an all-reduce).
stop_rank_1 pipe "the last pipeline stage" \
  "\(pipeline executor .*: pipeline: receive from rank 1 tag [0-9]* ([a-z0-9]* \[[0-9,]*\]):\|$all_reduce\)" \
  --pipeline-model-parallel-size 2

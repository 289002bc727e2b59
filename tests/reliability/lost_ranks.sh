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
fail() { echo "FAIL: $*"; exit 1; }
lines() { if [ -f "$1" ]; then wc -l <"$1"; else echo 0; fi; }
wait_lines() {  # FILE COUNT PID: until the metrics file has COUNT steps (120 s at most)
  for _ in $(seq 1200); do
    [ "$(lines "$1")" -ge "$2" ] && return 0
    kill -0 "$3" 2>/dev/null || fail "process $3 ended before $2 steps in $1"
    sleep 0.1
  done
  fail "no $2 steps in $1 after 120 s"
}
rank_pid() {  # TAG RANK: the pid of that world rank of the run whose metrics file is TAG
  local pid
  for pid in $(pgrep -f -- "--metrics $1"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$pid"
      return 0
    fi
  done
  fail "no process of rank $2 for $1"
}
# LAUNCHER LIMIT: waits for mpirun to end (LIMIT seconds at most); sets status and elapsed.
wait_job() {
  local start=$SECONDS
  for _ in $(seq $(($2 * 10))); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$1" 2>/dev/null && fail "the job still runs $2 s after the signal (hung)"
  status=0
  wait "$1" || status=$?
  elapsed=$((SECONDS - start))
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

# 2. SIGSTOP to rank 1 of two data-parallel ranks.
mpirun -np 2 --oversubscribe "$octet" "${train[@]}" --comm-timeout "$timeout_s" \
  --metrics "$dir/stop.jsonl" >"$dir/stop.log" 2>&1 &
launcher=$!
wait_lines "$dir/stop.jsonl" 3 "$launcher"
victim="$(rank_pid "$dir/stop.jsonl" 1)"
t0=$(now_ms)
kill -STOP "$victim"
wait_job "$launcher" $((timeout_s + 60))
ms=$(($(now_ms) - t0))
[ "$status" -ne 0 ] || fail "mpirun exited 0 after a rank was stopped"
grep -q "octet: error on rank 0: .*: still pending after $timeout_s s (no answer to a roll call within [0-9.]* s from rank 1 (pid $victim on .*): stopped, hung or unreachable)" \
  "$dir/stop.log" || { cat "$dir/stop.log"; fail "rank 0 does not name the stopped rank 1 (pid $victim)"; }
echo "ok: SIGSTOP to rank 1 (pid $victim): the job ended in $ms ms with --comm-timeout $timeout_s:"
grep -m1 "octet: error on rank 0: " "$dir/stop.log" | sed 's/^/    /' 

# 3. SIGSTOP to the last of two pipeline stages.
mpirun -np 2 --oversubscribe "$octet" "${train[@]}" --pipeline-model-parallel-size 2 \
  --comm-timeout "$timeout_s" --metrics "$dir/pipe.jsonl" >"$dir/pipe.log" 2>&1 &
launcher=$!
wait_lines "$dir/pipe.jsonl" 3 "$launcher"
victim="$(rank_pid "$dir/pipe.jsonl" 1)"
t0=$(now_ms)
kill -STOP "$victim"
wait_job "$launcher" $((timeout_s + 60))
ms=$(($(now_ms) - t0))
[ "$status" -ne 0 ] || fail "mpirun exited 0 after a pipeline stage was stopped"
grep -q "octet: error on rank 0: .*still pending after $timeout_s s (no answer to a roll call within [0-9.]* s from rank 1 (pid $victim on " \
  "$dir/pipe.log" || { cat "$dir/pipe.log"; fail "stage 0 does not name the stopped stage (rank 1, pid $victim)"; }
echo "ok: SIGSTOP to pipeline stage 1 (pid $victim): the job ended in $ms ms with --comm-timeout $timeout_s:"
grep -m1 "octet: error on rank 0: " "$dir/pipe.log" | sed 's/^/    /' 

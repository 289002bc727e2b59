# Helpers shared by the reliability scripts (sourced): runs of `octet train` watched through
# their --metrics files (one line per step).
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
rank_pid() {  # METRICS RANK: the pid of that world rank of the mpirun job writing METRICS
  local pid
  for pid in $(pgrep -f -- "--metrics $1"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$pid"
      return 0
    fi
  done
  fail "no process of rank $2 for $1"
}

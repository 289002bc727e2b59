#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces joined by a veth pair, with addresses of
# this test's own (10.231.7.1 and .2, which exist only inside the namespaces). mpirun starts in
# the first; Open MPI's remote-shell agent option launches its daemon in the second (under its
# own host name) and the ranks talk over TCP only (no shared memory between the "hosts").
#   1. DP=2 x PP=2 of octet train with the pipeline split across the hosts, and again with
#      each data-parallel pair split across them (--map-by node): the single-process losses
#      and gradient norms, step by step;
#   2. the second host's link taken down mid-run: the job ends with a message within a bound
#      (Open MPI's daemons notice with TCP keepalives; octet's own waits with --comm-timeout).
# Needs root and network namespaces (ip netns); exits 77 (skipped) where they are missing.
# Usage: multi_host.sh OCTET_BINARY
set -euo pipefail
octet="$1"
source "$(dirname "$0")/common.sh"
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
  echo "skipped: needs root, ip (iproute2) and unshare"
  exit 77
fi
dir="$(mktemp -d)"
a="octet-$$-a" b="octet-$$-b"
cleanup() {
  pkill -KILL -f -- "$dir" 2>/dev/null || true
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
if ! ip netns add "$a" 2>"$dir/netns.err"; then
  echo "skipped: cannot create a network namespace: $(cat "$dir/netns.err")"
  exit 77
fi
ip netns add "$b"
ip link add "o$$a" type veth peer name "o$$b"
ip link set "o$$a" netns "$a"
ip link set "o$$b" netns "$b"
ip -n "$a" addr add 10.231.7.1/24 dev "o$$a"
ip -n "$b" addr add 10.231.7.2/24 dev "o$$b"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "o$$a" up
ip -n "$b" link set "o$$b" up

# mpirun's remote shell: `agent HOST COMMAND...` runs COMMAND in HOST's namespace, as ssh would.
cat >"$dir/agent.sh" <<EOF
#!/bin/bash
host="\$1"; shift
case "\$host" in
  10.231.7.1) ns="$a" name=octet-host-a ;;
  10.231.7.2) ns="$b" name=octet-host-b ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" unshare --uts /bin/sh -c "hostname \$name; \$*"
EOF
chmod +x "$dir/agent.sh"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
# TCP between the hosts, on the test's subnet only; the daemons' connections probe an idle peer
# every second (a lost host is noticed in ~4 s instead of TCP's minutes).
launch=(ip netns exec "$a" unshare --uts /bin/sh -c 'hostname octet-host-a; exec "$@"' sh
  mpirun -np 4 --host 10.231.7.1:2,10.231.7.2:2
  --mca plm_rsh_agent "$dir/agent.sh" --mca btl tcp,self
  --mca btl_tcp_if_include 10.231.7.0/24 --mca oob_tcp_if_include 10.231.7.0/24
  --mca oob_tcp_keepalive_time 1 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3
  -x OMP_NUM_THREADS)
common=(train --config gpt-tiny --mock-data --precision fp32 --micro-batch-size 2
  --global-batch-size 8 --log-interval 1 --eval-iters 0 --peak-gflops 100 --clip-grad 0.5)
losses() { grep -oE '(loss|grad norm) [0-9.]+' | head -n 8 | tr '\n' ' '; }

# Where each rank runs, as its host name says.
for mapping in "slot a a b b" "node a b a b"; do
  set -- $mapping
  where="$("${launch[@]}" --map-by "$1" sh -c 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname)"' |
    sort | tr '\n' ' ')"
  [ "$where" = "rank 0 on octet-host-$2 rank 1 on octet-host-$3 rank 2 on octet-host-$4 rank 3 on octet-host-$5 " ] ||
    fail "--map-by $1 placed the ranks: $where"
  echo "ok: --map-by $1: $where"
done

reference="$("$octet" "${common[@]}" --train-iters 4 2>&1 | losses)"
[ -n "$reference" ] || fail "no losses from the single-process run"
echo "single process: $reference"
for mapping in slot node; do
  got="$("${launch[@]}" --map-by "$mapping" "$octet" "${common[@]}" --train-iters 4 \
    --pipeline-model-parallel-size 2 --metrics "$dir/map-$mapping.jsonl" 2>&1 | tee "$dir/$mapping.log" | losses)" ||
    { cat "$dir/$mapping.log"; fail "the run mapped by $mapping failed"; }
  [ "$got" = "$reference" ] || { cat "$dir/$mapping.log"; fail "DPxPP mapped by $mapping: $got"; }
  echo "ok: DP=2 x PP=2 across the hosts (--map-by $mapping) gives the single-process losses"
done

# The second host's link goes down after 3 steps.
"${launch[@]}" "$octet" "${common[@]}" --train-iters 100000 --pipeline-model-parallel-size 2 \
  --comm-timeout 5 --metrics "$dir/down.jsonl" >"$dir/down.log" 2>&1 &
launcher=$!
wait_lines "$dir/down.jsonl" 3 "$launcher"
start=$(date +%s%3N)
ip -n "$b" link set "o$$b" down
for _ in $(seq 600); do
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$launcher" 2>/dev/null && { cat "$dir/down.log"; fail "the job still runs 60 s after the link went down"; }
status=0
wait "$launcher" || status=$?
ms=$(($(date +%s%3N) - start))
[ "$status" -ne 0 ] || fail "mpirun exited 0 after a host was lost"
message="$(grep -m1 -oE "ORTE has lost communication with a remote daemon|no answer to a roll call within [0-9.]+ s from rank [0-9]+ \(pid [0-9]+ on octet-host-b\)" "$dir/down.log")" ||
  { cat "$dir/down.log"; fail "no message about the lost host"; }
sleep 1
pgrep -f -- "--metrics $dir/down.jsonl" >/dev/null && fail "octet processes outlived the job"
echo "ok: link of the second host down after step 3: the job ended in $ms ms (status $status): $message"

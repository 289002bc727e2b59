#!/usr/bin/env bash
# `octet serve` end to end: a tiny checkpoint served on a free port answers curl (a completion,
# a stream ending in [DONE], a 400 naming the field, /health, /v1/models, /metrics), and
# SIGTERM drains it: a request in flight still gets its whole answer, then the server exits 0.
# Usage: serve.sh OCTET_BINARY
set -euo pipefail
octet="$1"
dir="$(mktemp -d)"
server=""
cleanup() {
  if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -KILL "$server"; fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  [ -f "$dir/serve.log" ] && sed 's/^/  serve: /' "$dir/serve.log"
  exit 1
}
export OMP_NUM_THREADS=1

"$octet" train --config gpt-tiny --mock-data --train-iters 2 --micro-batch-size 2 \
  --save "$dir/ckpt" >"$dir/train.log" 2>&1 || fail "train: $(tail -n 3 "$dir/train.log")"

"$octet" serve --ckpt "$dir/ckpt" --port 0 --model-name tiny >"$dir/serve.log" 2>&1 &
server=$!
port=""
for _ in $(seq 600); do
  port=$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$dir/serve.log")
  [ -n "$port" ] && break
  kill -0 "$server" 2>/dev/null || fail "octet serve ended before listening"
  sleep 0.1
done
[ -n "$port" ] || fail "octet serve did not say where it listens within 60 s"
grep -q "memory: KV cache" "$dir/serve.log" || fail "no memory report"
url="http://127.0.0.1:$port"
post() { curl -sS -H 'Content-Type: application/json' "$url/v1/completions" -d "$1"; }

post '{"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}' >"$dir/one.json"
python3 - "$dir/one.json" <<'PY' || fail "completion: $(cat "$dir/one.json")"
import json, sys
answer = json.load(open(sys.argv[1]))
assert answer["object"] == "text_completion" and answer["model"] == "tiny", answer
choice = answer["choices"][0]
assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["text"], str), choice
assert answer["usage"]["completion_tokens"] >= 1, answer["usage"]
PY
echo "ok: completion"

post '{"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": true}' >"$dir/stream.txt"
python3 - "$dir/stream.txt" "$dir/one.json" <<'PY' || fail "stream: $(cat "$dir/stream.txt")"
import json, sys
events = [e for e in open(sys.argv[1]).read().split("\n\n") if e]
assert events[-1] == "data: [DONE]", events[-1:]
text = "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1])
assert text == json.load(open(sys.argv[2]))["choices"][0]["text"], text
PY
echo "ok: stream equals the completion"

status=$(curl -sS -o "$dir/bad.json" -w '%{http_code}' -H 'Content-Type: application/json' \
  "$url/v1/completions" -d '{"prompt": "Hello", "temperature": -1}')
[ "$status" = 400 ] || fail "bad temperature: HTTP $status"
grep -q '"param":"temperature"' "$dir/bad.json" || fail "400 without the field: $(cat "$dir/bad.json")"
[ "$(curl -sS "$url/health")" = '{"status":"ok"}' ] || fail "/health"
curl -sS "$url/v1/models" | grep -q '"id":"tiny"' || fail "/v1/models"
curl -sS "$url/metrics" >"$dir/metrics.txt"
grep -q '^octet_requests_total{status="ok"} 2$' "$dir/metrics.txt" ||
  fail "metrics: $(grep octet_requests_total "$dir/metrics.txt")"
grep -q '^octet_requests_total{status="bad_request"} 1$' "$dir/metrics.txt" || fail "metrics: bad_request"
grep -q '^# TYPE octet_time_to_first_token_seconds histogram$' "$dir/metrics.txt" || fail "metrics: TTFT"
echo "ok: 400 naming the field, /health, /v1/models, /metrics"

# SIGTERM with a long request in flight: it completes, then the server exits 0.
post '{"prompt": "Hello", "max_tokens": 60, "temperature": 0}' >"$dir/long.json" &
client=$!
for _ in $(seq 600); do
  in_engine=0
  for count in $(curl -sS "$url/metrics" | sed -n 's/^octet_requests_\(running\|waiting\) \([0-9]*\)$/\2/p'); do
    in_engine=$((in_engine + count))
  done
  [ "$in_engine" -ge 1 ] && break
  [ -s "$dir/long.json" ] && break  # answered already
  sleep 0.05
done
kill -TERM "$server"
wait "$client" || fail "the request in flight got no answer"
code=0
wait "$server" || code=$?
server=""
[ "$code" = 0 ] || fail "octet serve exited $code after SIGTERM, expected 0"
grep -q '"object":"text_completion"' "$dir/long.json" || fail "in-flight answer: $(cat "$dir/long.json")"
grep -q "SIGTERM: draining" "$dir/serve.log" || fail "no draining message"
echo "ok: SIGTERM drained the request in flight and exited 0"

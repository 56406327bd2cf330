#!/usr/bin/env bash
# The scaled-out shape on one machine, on loopback ports: one redis-server (the shared KV tier),
# one Chroma server (the shared vectors) and N `turborag serve` workers that share both.
#
#   bash scripts/cluster.sh up [N]      # default N=2; prints the URLs, writes .cluster/
#   bash scripts/cluster.sh status
#   bash scripts/cluster.sh down
#
# Ports: REDIS_PORT (6390), CHROMA_PORT (8300), first worker WORKER_PORT (8400, then +1 ...),
# apart from the defaults of `turborag serve` (8000) and `turborag vllm` (8100).
# Workers: MAX_BATCH (requests decoded together, default 8), MAX_QUEUE (waiting requests before
# a 429, default 64), MODE (turbo, or naive for the baseline), THREADS (torch threads per
# worker, default: the machine's cores split between the workers, at least 1: workers that
# each take every core fight over them); TURBORAG_API_KEY, when set, is required by every
# worker's /v1/ endpoints.
# Each worker keeps its own disk tier under .cluster/kv-<i>; blobs one worker encodes reach the
# others through Redis. Needs redis-server (apt install redis-server) and the [server,redis]
# extras. Nothing listens beyond 127.0.0.1 (Redis and Chroma have no authentication).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=.cluster
PY=${PYTHON:-.venv/bin/python}
REDIS_PORT=${REDIS_PORT:-6390}
CHROMA_PORT=${CHROMA_PORT:-8300}
WORKER_PORT=${WORKER_PORT:-8400}
MAX_BATCH=${MAX_BATCH:-8}
MAX_QUEUE=${MAX_QUEUE:-64}
MODE=${MODE:-turbo}

wait_for() {  # url, what
  for _ in $(seq 1 600); do
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('$1', timeout=2).status_code != 200)" \
        2>/dev/null; then return 0; fi
    sleep 1
  done
  echo "$2 did not answer at $1 (see $RUN/*.log)" >&2
  return 1
}

up() {
  local n=${1:-2}
  mkdir -p "$RUN"
  command -v redis-server >/dev/null || { echo "redis-server is missing: apt install redis-server" >&2; exit 2; }
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --daemonize yes --pidfile "$PWD/$RUN/redis.pid" --logfile "$PWD/$RUN/redis.log"
  "$(dirname "$PY")/chroma" run --path "$RUN/chroma" --host 127.0.0.1 --port "$CHROMA_PORT" \
    > "$RUN/chroma.log" 2>&1 &
  echo $! > "$RUN/chroma.pid"
  wait_for "http://127.0.0.1:$CHROMA_PORT/api/v2/heartbeat" "Chroma"
  local threads=${THREADS:-$(( $(nproc) / n ))}
  [ "$threads" -ge 1 ] || threads=1
  for i in $(seq 0 $((n - 1))); do
    port=$((WORKER_PORT + i))
    TURBORAG_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0" OMP_NUM_THREADS="$threads" \
      "$PY" -m turborag_integrations.cli serve --host 127.0.0.1 --port "$port" \
      --kv-store "$RUN/kv-$i" --max-batch "$MAX_BATCH" --max-queue "$MAX_QUEUE" --mode "$MODE" \
      --threads "$threads" > "$RUN/worker-$i.log" 2>&1 &
    echo $! > "$RUN/worker-$i.pid"
  done
  for i in $(seq 0 $((n - 1))); do
    wait_for "http://127.0.0.1:$((WORKER_PORT + i))/health" "worker $i"
  done
  echo "redis:   redis://127.0.0.1:$REDIS_PORT/0"
  echo "chroma:  http://127.0.0.1:$CHROMA_PORT   (--chroma-url / TURBORAG_CHROMA_URL)"
  for i in $(seq 0 $((n - 1))); do
    echo "worker:  http://127.0.0.1:$((WORKER_PORT + i))/v1   (torch threads: $threads)"
  done
}

down() {
  for pidfile in "$RUN"/*.pid; do
    [ -e "$pidfile" ] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  done
  echo "stopped (data stays in $RUN/; remove it to start afresh)"
}

status() {
  for pidfile in "$RUN"/*.pid; do
    [ -e "$pidfile" ] || { echo "nothing running"; return; }
    name=$(basename "$pidfile" .pid)
    if kill -0 "$(cat "$pidfile")" 2>/dev/null; then echo "$name: running"; else echo "$name: stopped"; fi
  done
}

case "${1:-}" in
  up) up "${2:-2}" ;;
  down) down ;;
  status) status ;;
  *) echo "usage: bash scripts/cluster.sh up [N] | status | down" >&2; exit 2 ;;
esac

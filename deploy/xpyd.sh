#!/usr/bin/env bash
# X prefill servers, Y decode servers and the proxy on this machine.
#
#   deploy/xpyd.sh --prefill X --decode Y [--model DIR|FILE.gguf] [--port 8000] [--policy P]
#                  [--prefill-base-port 8100] [--decode-base-port 8200] [--dtype D]
#                  [--num-threads T] [--prefill-tp N] [--decode-tp N] [--detach] [-- EXTRA pd serve FLAGS]
#   deploy/xpyd.sh stop
#
# Starts every server (P with --role prefill, D with --role decode: NIXL between them),
# waits until each answers /health (how many do, on stderr: a bar on a terminal, a few
# plain lines otherwise), starts `pd proxy` in front, prints the URLs, and
# stops everything it started on Ctrl-C, or with `deploy/xpyd.sh stop` (from another
# shell, or after --detach). Without --model it makes a tiny Bamba (Mamba2 + attention)
# with `pd make-model`. The machine's cores are split between the servers (--num-threads,
# default cores / (X + Y), at least 1; per rank). --prefill-tp / --decode-tp: the
# tensor-parallel size of each prefill / decode server (default 1; they may differ). PIDs
# and logs go to $PD_DEPLOY_DIR (default ${TMPDIR:-/tmp}/pd-deploy-$UID); processes are
# stopped by those PIDs only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${PD_DEPLOY_DIR:-${TMPDIR:-/tmp}/pd-deploy-$(id -u)}"
PIDS="$STATE/pids"
PD="${PD:-$ROOT/.venv/bin/pd}"
[ -x "$PD" ] || PD="$(command -v pd || true)"

usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

stop_all() {
    [ -f "$PIDS" ] || { echo "xpyd: nothing to stop ($PIDS not found)"; return 0; }
    local pid
    # Newest first: the proxy, then the servers.
    for pid in $(tac "$PIDS"); do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 200); do
        local alive=0
        for pid in $(cat "$PIDS"); do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pid in $(cat "$PIDS"); do kill -KILL "$pid" 2>/dev/null || true; done
    rm -f "$PIDS"
    echo "xpyd: stopped everything it started"
}

if [ "${1:-}" = "stop" ]; then stop_all; exit 0; fi

NUM_P=1 NUM_D=1 MODEL="" PORT=8000 POLICY=round_robin P_BASE=8100 D_BASE=8200 DTYPE=auto
THREADS="" DETACH=0 EXTRA=() P_TP=1 D_TP=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefill) NUM_P="$2"; shift 2 ;;
        --decode) NUM_D="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --policy) POLICY="$2"; shift 2 ;;
        --prefill-base-port) P_BASE="$2"; shift 2 ;;
        --decode-base-port) D_BASE="$2"; shift 2 ;;
        --dtype) DTYPE="$2"; shift 2 ;;
        --num-threads) THREADS="$2"; shift 2 ;;
        --prefill-tp) P_TP="$2"; shift 2 ;;
        --decode-tp) D_TP="$2"; shift 2 ;;
        --detach) DETACH=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "xpyd: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$NUM_P" =~ ^[1-9][0-9]*$ && "$NUM_D" =~ ^[1-9][0-9]*$ ]] || { echo "xpyd: --prefill and --decode must be positive integers" >&2; exit 2; }
[[ "$P_TP" =~ ^[1-9][0-9]*$ && "$D_TP" =~ ^[1-9][0-9]*$ ]] || { echo "xpyd: --prefill-tp and --decode-tp must be positive integers" >&2; exit 2; }
[ -n "$PD" ] || { echo "xpyd: no pd command: install the project first (see README)" >&2; exit 1; }
if [ -f "$PIDS" ]; then
    for pid in $(cat "$PIDS"); do
        if kill -0 "$pid" 2>/dev/null; then echo "xpyd: a deployment is running (pid $pid); 'deploy/xpyd.sh stop' first" >&2; exit 1; fi
    done
fi
mkdir -p "$STATE"
: > "$PIDS"
[ -n "$THREADS" ] || THREADS=$(( $(nproc) / (NUM_P * P_TP + NUM_D * D_TP) )); [ "$THREADS" -ge 1 ] || THREADS=1
if [ -z "$MODEL" ]; then
    MODEL="$STATE/tiny-bamba"
    [ -f "$MODEL/config.json" ] || "$PD" make-model --arch bamba --out "$MODEL" > /dev/null
fi
export NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}"
# One secret per deployment: P signs the kv_transfer_params it returns, D acts only on
# signed ones. In the environment, not on the command line (`ps` would show it).
export PD_KV_TRANSFER_SECRET="${PD_KV_TRANSFER_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"

on_exit() { [ "$DETACH" = 1 ] || stop_all; }
trap on_exit EXIT
trap 'exit 130' INT TERM

start() {  # name port args...: start one process in the background, remember its PID
    local name="$1"; shift
    "$@" > "$STATE/$name.log" 2>&1 < /dev/null &
    echo $! >> "$PIDS"
}

show_healthy() {  # what healthy total started: a redrawn bar on a terminal, else a plain line per tenth
    local elapsed=$((SECONDS - $4))
    if [ -t 2 ]; then
        local bar; bar="$(printf '%*s' $((20 * $2 / $3)) '' | tr ' ' '#')"
        printf '\rxpyd: %s |%-20s| %d/%d, %d s' "$1" "$bar" "$2" "$3" "$elapsed" >&2
        [ "$2" -lt "$3" ] || echo >&2
    elif [ $((10 * $2 / $3)) -gt "$SHOWN" ]; then
        SHOWN=$((10 * $2 / $3))
        echo "xpyd: $1: $2/$3 ($((100 * $2 / $3))%, $elapsed s)" >&2
    fi
}

wait_healthy() {  # what name=url...: until each answers /health (180 s), how many do shown on stderr
    local what="$1" started=$SECONDS; shift
    local total=$# pending=("$@") entry still
    SHOWN=0
    for _ in $(seq 1800); do
        still=()
        for entry in "${pending[@]}"; do
            curl -sf "${entry#*=}/health" > /dev/null 2>&1 || still+=("$entry")
        done
        pending=(${still[@]+"${still[@]}"})
        show_healthy "$what" $((total - ${#pending[@]})) "$total" "$started"
        [ ${#pending[@]} -gt 0 ] || return 0
        sleep 0.1
    done
    [ ! -t 2 ] || echo >&2
    entry="${pending[0]%%=*}"
    echo "xpyd: $entry not healthy after 180 s; its log ($STATE/$entry.log) ends:" >&2
    tail -20 "$STATE/$entry.log" >&2
    exit 1
}

P_URLS=() D_URLS=()
for i in $(seq 0 $((NUM_P - 1))); do
    start "prefill-$i" "$PD" serve --model "$MODEL" --host 127.0.0.1 --port $((P_BASE + i)) --role prefill \
        --dtype "$DTYPE" --num-threads "$THREADS" --tensor-parallel-size "$P_TP" "${EXTRA[@]}"
    P_URLS+=("http://127.0.0.1:$((P_BASE + i))")
done
for i in $(seq 0 $((NUM_D - 1))); do
    start "decode-$i" "$PD" serve --model "$MODEL" --host 127.0.0.1 --port $((D_BASE + i)) --role decode \
        --dtype "$DTYPE" --num-threads "$THREADS" --tensor-parallel-size "$D_TP" "${EXTRA[@]}"
    D_URLS+=("http://127.0.0.1:$((D_BASE + i))")
done
SERVERS=()
for i in $(seq 0 $((NUM_P - 1))); do SERVERS+=("prefill-$i=${P_URLS[$i]}"); done
for i in $(seq 0 $((NUM_D - 1))); do SERVERS+=("decode-$i=${D_URLS[$i]}"); done
wait_healthy "servers healthy" "${SERVERS[@]}"
start proxy "$PD" proxy --prefill "${P_URLS[@]}" --decode "${D_URLS[@]}" --host 127.0.0.1 --port "$PORT" --policy "$POLICY"
wait_healthy "proxy healthy" "proxy=http://127.0.0.1:$PORT"

echo "xpyd: ${NUM_P}P${NUM_D}D of $MODEL (TP $P_TP / $D_TP), $THREADS thread(s) per rank, policy $POLICY"
echo "  prefill: ${P_URLS[*]}"
echo "  decode:  ${D_URLS[*]}"
echo "  proxy:   http://127.0.0.1:$PORT  (OpenAI API under /v1; logs in $STATE)"
if [ "$DETACH" = 1 ]; then
    echo "  detached: stop with 'deploy/xpyd.sh stop'"
    exit 0
fi
echo "  Ctrl-C stops everything"
while :; do
    for pid in $(cat "$PIDS"); do
        kill -0 "$pid" 2>/dev/null || { echo "xpyd: process $pid exited; stopping the rest" >&2; exit 1; }
    done
    sleep 1
done

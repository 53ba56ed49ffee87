#!/bin/bash
# deploy/fleet.py (pd planner on Ray: 1P1D at the start, up to 3 servers) against
# deploy/ray_pd.py (a fixed 1P1D on Ray): the same servers and load, interleaved (ABBA), 3 runs each.
# The load: 72 prompts of 1024 tokens, 8 generated, at 1.2 req/s, then 30 s idle.
#   benchmarks/ray_fleet_ab.sh MODEL [OUT_DIR]     (results: OUT_DIR/<config>-<run>/long.json)
set -u
MODEL=${1:?usage: benchmarks/ray_fleet_ab.sh MODEL [OUT_DIR]}
BASE=${2:-results/ray-fleet-ab}
PY=${PYTHON:-.venv/bin/python}
PORT=${PORT:-18611}
mkdir -p "$BASE"
run() {  # config run
  local out="$BASE/$1-$2"
  mkdir -p "$out"
  if [ "$1" = planner ]; then
    RAY_USAGE_STATS_ENABLED=0 $PY deploy/fleet.py --model "$MODEL" --ttft-slo 3 --tpot-slo 0.05 \
      --start-prefill 1 --start-decode 1 --min-instances 2 --max-instances 3 --cpus-per-server 0.5 --port "$PORT" \
      --urls-file "$out/urls.json" --log-dir "$out/logs" --planner-args "--interval 1 --patience 2 --cooldown 5" \
      -- --num-threads 1 > "$out/deploy.log" 2>&1 &
  else
    RAY_USAGE_STATS_ENABLED=0 $PY deploy/ray_pd.py --model "$MODEL" --prefill 1 --decode 1 --cpus-per-server 0.5 \
      --num-threads 1 --port "$PORT" --urls-file "$out/urls.json" --log-dir "$out/logs" -- --dtype auto \
      > "$out/deploy.log" 2>&1 &
  fi
  local pid=$!
  for _ in $(seq 1 150); do [ -f "$out/urls.json" ] && break; sleep 2; done
  $PY -m cli.main bench serve --base-url "http://127.0.0.1:$PORT" --dataset random --random-input-len 1024 \
    --random-output-len 8 --request-rate 1.2 --num-prompts 72 --ignore-eos --seed "$2" \
    --result-file "$out/long.json" > "$out/long.log" 2>&1
  sleep 30
  kill -TERM "$pid"; wait "$pid"
}
for rep in 0 1 2; do
  if [ $((rep % 2)) = 0 ]; then run planner $rep; run static1p1d $rep; else run static1p1d $rep; run planner $rep; fi
done

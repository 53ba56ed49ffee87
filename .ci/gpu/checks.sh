#!/usr/bin/env bash
# The GPU checks, run on the device tool's machine after .ci/gpu/prepare.sh here:
#   run(command="bash .ci/gpu/checks.sh", carry=[".whl"], timeout_s=480)
# The CUDA tests (NIXL moving device memory included), D's KV read speed under UCX settings,
# then colocated vs PD on one GPU.
set -o pipefail
T0=$(date +%s); at() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
tar xJf .whl/nixl_slim.tar.xz -C /tmp/site || exit 4
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
at tests
timeout "${TEST_S:-210}" python3 -m pytest -q -n 4 --dist loadfile -p no:cacheprovider --durations=12 -rs \
  tests/pd/cuda tests/pd/attention/test_torch_backend.py tests/connectors/nixl/test_transport.py 2>&1 \
  | tee "$OUT/tests.log" | tail -25
at model
python3 -m cli.main make-model --arch qwen3 --out /tmp/tiny-qwen3 >/dev/null
python3 .ci/gpu/make_model.py /tmp/tiny-qwen3 /tmp/qwen3-0.6b-shaped 2>&1 | tail -1
at kv-reads
timeout "${READS_S:-120}" python3 .ci/gpu/kv_reads.py /tmp/qwen3-0.6b-shaped 2>&1 | tee "$OUT/kv_reads.log"
at bench
timeout "${BENCH_S:-200}" python3 -m cli.main bench compare --model /tmp/qwen3-0.6b-shaped --dtype bfloat16 \
  --configs colocated,pd --num-prompts 64 --warmup-prompts 8 --max-concurrency 16 --dataset random \
  --random-input-len 1024 --random-output-len 64 --ignore-eos --repetitions "${REPS:-3}" \
  --server-args "--device cuda --kv-cache-memory 4000000000" --output-dir /tmp/compare 2>&1 | tee "$OUT/compare.log" | tail -12
cp /tmp/compare/compare.md /tmp/compare/compare.json "$OUT/" 2>/dev/null
at done

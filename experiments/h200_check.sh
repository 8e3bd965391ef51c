#!/usr/bin/env bash
# One GPU session's checks, in the order that matters if time runs out:
#   1. python -m experiments.benchmark --preset h200 (bf16 GPT-2-medium and LLaMA-1B train
#      steps with MFU; cudnn / pallas / blockwise / dense attention at 4k-32k);
#   2. tests/layers/test_gpu_attention.py (cudnn and pallas equal dense on the GPU);
#   3. --preset h200 --only blocks: blockwise fwd+bwd per block size (256-2048) at 8k and
#      16k beside dense and cudnn (does model.blockwise_block_q/_k want larger blocks?).
# Usage: bash experiments/h200_check.sh OUT_DIR [all|bench|tests|blocks]
# On one H200 (2026-12-04) the benchmark took ~280 s and the tests ~13 s each: `bench` and
# `tests` fit one 10-minute call; `blocks` (unmeasured yet) may need its own call.
# On a machine whose Python lacks some of tx_jax's pure dependencies, put their wheels in
# .whl/ (and a newer protobuf in .whl/extra/); they are installed to a scratch folder.
set -u
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "error: usage: bash experiments/h200_check.sh OUT_DIR [all|bench|tests|blocks]" >&2; exit 2
fi
out=$1
mode=${2:-all}
case "$mode" in
  all|bench|tests|blocks) ;;
  *) echo "error: mode '$mode' is not one of all, bench, tests, blocks" >&2; exit 2;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} TX_JAX_TEST_FAST_COMPILE=0
python=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  if ! $python -c "import grain" 2>/dev/null && ls .whl/extra/*.whl >/dev/null 2>&1; then
    echo "grain does not import with this protobuf; installing .whl/extra" >&2
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/extra/*.whl || exit 1
  fi
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $python -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
} 2>&1 | tee "$out/env.txt"

bench_rc=0
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  timeout "${BENCH_TIMEOUT:-330}" $python -m experiments.benchmark --preset h200 --out "$out/h200" \
    --only train,attention ${BENCH_ARGS:-} 2>&1 | tee "$out/benchmark.log"
  bench_rc=${PIPESTATUS[0]}
fi

test_rc=0
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  timeout "${TEST_TIMEOUT:-330}" $python -m pytest -p no:cacheprovider -n 0 -rfE -v \
    --junitxml="$out/gpu_tests.xml" tests/layers/test_gpu_attention.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed"
  test_rc=${PIPESTATUS[0]}
fi

# benchmark.json is updated section by section: the blocks join train and attention there.
blocks_rc=0
if [ "$mode" = all ] || [ "$mode" = blocks ]; then
  timeout "${BLOCKS_TIMEOUT:-300}" $python -m experiments.benchmark --preset h200 --out "$out/h200" \
    --only blocks ${BENCH_ARGS:-} 2>&1 | tee "$out/blocks.log"
  blocks_rc=${PIPESTATUS[0]}
fi

echo "benchmark rc=$bench_rc, gpu tests rc=$test_rc, blocks rc=$blocks_rc"
[ -f "$out/h200/benchmark.json" ] && $python - "$out/h200/benchmark.json" <<'EOF' || true
import json, sys
report = json.load(open(sys.argv[1]))
for row in report.get("train", {}).get("rows", []):
  print("train", row.get("model"), row.get("attention_backend"), "step_ms=%s" % row.get("step_ms"),
        "mfu=%s" % row.get("mfu"), "first_step_s=%s" % row.get("first_step_s"), row.get("error", ""))
for section in ("attention", "blocks"):
  for row in report.get(section, {}).get("rows", []):
    print(section, row["backend"], row["seq_len"], "block=%s" % row.get("block"),
          "time_ms=%s" % row["time_ms"], "peak_bytes=%s" % row["peak_bytes"],
          row.get("note", "")[:120])
EOF
[ "$bench_rc" = 0 ] && [ "$test_rc" = 0 ] && [ "$blocks_rc" = 0 ]

#!/usr/bin/env bash
# One GPU session's checks, in the order that matters if time runs out:
#   1. python -m experiments.benchmark --preset h200 (bf16 GPT-2-medium and LLaMA-1B train
#      steps with MFU; cudnn / pallas / blockwise / dense attention at 4k-32k);
#   2. tests/layers/test_gpu_attention.py (cudnn and pallas equal dense on the GPU).
# Usage: bash experiments/h200_check.sh OUT_DIR [all|bench|tests]
# On one H200 (2026-12-04) the benchmark took ~280 s and the tests ~13 s each: `all` fits
# one 10-minute call; `bench` and `tests` split it over two.
# On a machine whose Python lacks some of tx_jax's pure dependencies, put their wheels in
# .whl/ (and a newer protobuf in .whl/extra/); they are installed to a scratch folder.
set -u
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "error: usage: bash experiments/h200_check.sh OUT_DIR [all|bench|tests]" >&2; exit 2
fi
out=$1
mode=${2:-all}
case "$mode" in
  all|bench|tests) ;;
  *) echo "error: mode '$mode' is not one of all, bench, tests" >&2; exit 2;;
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
if [ "$mode" != tests ]; then
  timeout "${BENCH_TIMEOUT:-330}" $python -m experiments.benchmark --preset h200 --out "$out/h200" ${BENCH_ARGS:-} \
    2>&1 | tee "$out/benchmark.log"
  bench_rc=${PIPESTATUS[0]}
fi

test_rc=0
if [ "$mode" != bench ]; then
  timeout "${TEST_TIMEOUT:-330}" $python -m pytest -p no:cacheprovider -n 0 -rfE -v \
    --junitxml="$out/gpu_tests.xml" tests/layers/test_gpu_attention.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed"
  test_rc=${PIPESTATUS[0]}
fi

echo "benchmark rc=$bench_rc, gpu tests rc=$test_rc"
[ -f "$out/h200/benchmark.json" ] && $python - "$out/h200/benchmark.json" <<'EOF' || true
import json, sys
report = json.load(open(sys.argv[1]))
for row in report.get("train", {}).get("rows", []):
  print("train", row.get("model"), row.get("attention_backend"), "step_ms=%s" % row.get("step_ms"),
        "mfu=%s" % row.get("mfu"), "first_step_s=%s" % row.get("first_step_s"), row.get("error", ""))
for row in report.get("attention", {}).get("rows", []):
  print("attention", row["backend"], row["seq_len"], "time_ms=%s" % row["time_ms"],
        "peak_bytes=%s" % row["peak_bytes"], row.get("note", "")[:120])
EOF
[ "$bench_rc" = 0 ] && [ "$test_rc" = 0 ]

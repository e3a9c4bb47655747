#!/usr/bin/env bash
# The reliability checks that need a GPU, in one device call (run from the repository root):
#   bash tests/reliability/gpu_check.sh [CONFIG_DIR]
# 1. `nibble doctor` on the demo checkpoint (every GPU, Triton smoke test, self-test table, checkpoint check);
# 2. `nibble doctor --shapes-only` on CONFIG_DIR (a real model's config.json: self-tests at its shapes);
# 3. the reliability tests that touch the device, with NIBBLE_TEST_GPU=1: NaN guard and cache reuse on a
#    cuda engine, Triton NaN isolation on the GPU, load errors, engine churn with preemption and CUDA
#    graphs (the HTTP tests are device-independent and need the full fastapi stack).
# Wheels in .whl/ (fla-core, the fastapi stack) are installed first when present. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

step() {  # step NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, print rc and the log's tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
}

TAIL=60 step doctor_demo 200 python3 -m nibble.cli doctor --model demo
if [ -n "${1:-}" ]; then
  step doctor_shapes 240 python3 -m nibble.cli doctor --model "$1" --shapes-only --json
fi
R=tests/reliability
TAIL=25 NIBBLE_TEST_GPU=1 step reliability 300 python3 -m pytest -q $R/test_nan_guard.py \
  $R/test_nan_isolation_kernels.py $R/test_corrupt_checkpoint.py "$R/test_load.py::test_engine_churn_with_preemption" \
  -p no:cacheprovider -rf --durations=8

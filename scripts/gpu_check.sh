#!/usr/bin/env bash
# One device call: the GPU test suite, then the benchmark. Logs and results go under $OUT.
# Usage (on the device machine, repo root): bash scripts/gpu_check.sh [bench args...]
# Environment: SKIP_TESTS=1 / SKIP_BENCH=1 skip a part; PYTEST_ARGS picks tests (default: all);
# TEST_TIMEOUT caps the test part in seconds, so that the bench still runs within one device call;
# E2E=1 adds the end-to-end training benchmark (bench e2e) after the op benchmark, for the model
# shapes in E2E_MODELS (default: e2e; also smollm2-135m, qwen2.5-0.5b) and the stacks in E2E_STACKS
# (default: all).
set -uo pipefail
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
OUT=${OUT:-/tmp/tritonformer-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  timeout -s INT "${TEST_TIMEOUT:-0}" python3 -m pytest -q -rf --durations=15 -n "${PYTEST_WORKERS:-8}" -p no:cacheprovider -m "not gpu_memory" ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -25
  # Tests that take tens of GiB run alone: beside 8 workers they ran other tests out of memory.
  # shellcheck disable=SC2086
  python3 -m pytest -q -rf -p no:cacheprovider -m gpu_memory ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest-gpu-memory.log" | tail -3
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m tritonformer bench --out "$OUT/${BENCH_DIR:-bench}" "$@" 2>&1 | tee "$OUT/${BENCH_DIR:-bench}.log" | tail -60
fi
if [ "${E2E:-0}" = 1 ]; then
  python3 -m tritonformer bench e2e --model ${E2E_MODELS:-e2e} ${E2E_STACKS:+--stacks $E2E_STACKS} --out "$OUT/e2e" 2>&1 | tee "$OUT/e2e.log" | tail -15
fi

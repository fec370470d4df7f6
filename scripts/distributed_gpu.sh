#!/usr/bin/env bash
# One device call on a 2-GPU machine: scripts/distributed_check.py under DDP and FSDP2 (fp32 and
# bf16; FSDP2 also with lm_head as a unit of its own; a Qwen3-MoE model under both). Logs under
# $OUT; a summary line per run.
# Usage (on the device machine, repo root): bash scripts/distributed_gpu.sh
set -uo pipefail
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0; fi
OUT=${OUT:-/tmp/tritonformer-dist}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for run in "ddp" "fsdp2" "fsdp2 --lm-head-unit" "ddp --dtype bfloat16" "fsdp2 --dtype bfloat16" \
           "ddp --family qwen3_moe" "fsdp2 --family qwen3_moe" "fsdp2 --family qwen3_moe --dtype bfloat16"; do
  name=$(echo "$run" | tr ' ' '_' | tr -d '-')
  # shellcheck disable=SC2086
  timeout 240 torchrun --nproc-per-node 2 scripts/distributed_check.py --mode $run >"$OUT/$name.log" 2>&1
  echo "rc=$? $run: $(grep '^{' "$OUT/$name.log" | tail -1)"
done

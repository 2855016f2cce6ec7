#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one command, with a summary at the end.
# Run on a machine with a CUDA GPU from the repository root:
#   bash scripts/gpu_check.sh [OUT_DIR]
# Python: ./.venv if it has a CUDA torch, else the python3 on PATH if it has one (the repository is
# put on PYTHONPATH; wheels in ./.whl, if any, are installed into a scratch folder first: for a
# machine without internet, `pip download pulp highspy orloge cpsat-logutils -d .whl` elsewhere).
# OUT_DIR (default /tmp/hdp-gpu-check) receives the logs and the training metrics.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-/tmp/hdp-gpu-check}
mkdir -p "$OUT_DIR"
has_cuda() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
  PY=.venv/bin/python
elif has_cuda python3; then
  PY=python3
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/hdp-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/hdp-site
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no CUDA GPU visible to .venv/bin/python or python3: nothing to check"; exit 1
fi
$PY -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")'

declare -a summary
run() {  # run NAME COMMAND...: record pass/fail, keep the log
  local name=$1; shift
  echo "=== $name: $*"
  local log="$OUT_DIR/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_').log"
  if "$@" 2>&1 | tee "$log"; then summary+=("PASS  $name"); else summary+=("FAIL  $name"); fi
}
run "GPU kernel, cuDNN backend and dist_attn tests" $PY -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py \
  tests/test_cudnn_backend.py tests/test_dist_attn.py -k "gpu or cuda"
run "block-size benchmark" $PY scripts/bench_attention.py --gpu
# Each attention backend's forward and backward TFLOP/s on the shard shapes, side by side
# (llama-1b's head_dim 64, and 128).
for d in 64 128; do
  run "attention backends on shard shapes, head_dim $d" $PY scripts/bench_attention.py --backends --head-dim "$d"
done
# The cost model against this GPU: its kernel tables measured here, the shipped h100 profile and
# the measured one checked against the shared H100 tables (when ../shared is beside the checkout).
run "hdp-calibrate measure (CUDA)" $PY -m launch.calibrate measure --out "$OUT_DIR/profile.json"
for table in hdp/data/measured/h100_measured.csv hdp/data/measured/h100_cudnn_measured.csv; do
  [ -f "$table" ] || continue
  run "hdp-calibrate check h100 $(basename "$table")" $PY -m launch.calibrate check h100 --table "$table"
  run "hdp-calibrate check measured $(basename "$table")" \
    $PY -m launch.calibrate check "$OUT_DIR/profile.json" --table "$table"
done
# One rank on CUDA: NCCL process group, FSDP2 with bf16 mixed precision, the auto-selected attention
# backend in dist_attn (cuDNN on Hopper); then measured / predicted of every step (the target:
# 0.85-1.15 after the first two); then the plain packed-sequence loop (torch varlen flash, fused
# AdamW, full checkpointing) on the same batches, its tokens/s and MFU printed beside hdp's.
for seq in 32K 128K; do
  tokens=$([ "$seq" = 32K ] && echo 64K || echo 128K)
  workload=$([ "$seq" = 32K ] && echo wlb-128k || echo byted-2m)
  run "llama-1b training at $seq on CUDA (torchrun, NCCL, bf16)" $PY -m torch.distributed.run --standalone \
    --nproc-per-node 1 launch/pretrain.py --model llama-1b --workload "$workload" --max-seq "$seq" \
    --tokens-per-step "$tokens" --steps 8 --warmup 2 --activation-checkpointing \
    --metrics "$OUT_DIR/train_metrics_$seq.jsonl"
  run "measured / predicted at $seq" $PY scripts/bench_fidelity.py metrics "$OUT_DIR/train_metrics_$seq.jsonl"
  run "plain loop at $seq beside hdp" $PY scripts/plain_loop.py --model llama-1b --workload "$workload" \
    --max-seq "$seq" --tokens-per-step "$tokens" --steps 8 --compare "$OUT_DIR/train_metrics_$seq.jsonl"
done
# One rank's attention from real 1024-rank plans, run with the project's kernels (target: 0.9-1.1).
run "attention of real plans, measured / predicted" $PY scripts/bench_fidelity.py attention --gpus 1024 \
  --backends flash --device cuda
# The CPU suite under this machine's torch (a CUDA build): the gloo paths must not pick up the GPU.
# One test at a time, as CI runs it: the multi-rank tests pick free TCP ports, which tests running
# in parallel (pytest -n) can take from each other.
run "whole test suite" $PY -m pytest -q -rfE -p no:cacheprovider -p no:benchmark --timeout 600 tests
echo
echo "Summary ($(date -u +%Y-%m-%d), $($PY -c 'import torch; print(torch.cuda.get_device_name())')):"
printf '  %s\n' "${summary[@]}"
[[ "${summary[*]}" != *FAIL* ]]

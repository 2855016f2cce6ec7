#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one command, with a summary at the end.
# Run on a machine with a CUDA GPU from the repository root:
#   bash scripts/gpu_check.sh [--only SECTION,...] [--full] [OUT_DIR]
# Sections, in the order they run (each under its own time limit, so one hang costs its limit,
# not the whole lease): tests, train32k, backends, plans, train128k, blocks, calibrate. Run only
# when named: compile and fusedloss (after train32k: the same run with --no-compile or
# --fused-loss, tokens/s side by side), plain (the plain loop of hdp's model beside each training run) and
# suite (--full: the CPU test suite under the CUDA torch, 7-9 minutes on 16 cores). On an H200,
# tests, train32k, backends and plans took 3 minutes in all, train128k about 3 more, calibrate
# over 2; on an H100, train32k took 2 minutes, train128k about 3.5, compile and fusedloss 1-2 each.
# Python: ./.venv if it has a CUDA torch, else the python3 on PATH if it has one (the repository's
# folders are laid out as the hdp namespace in a scratch folder of links and put on PYTHONPATH;
# wheels in ./.whl, if any, are installed into a scratch folder first: for a machine without
# internet, `pip download pulp highspy -d .whl` elsewhere).
# OUT_DIR (default /tmp/hdp-gpu-check) receives the logs, the training metrics and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ONLY="tests,train32k,backends,plans,train128k,blocks,calibrate"
OUT_DIR=/tmp/hdp-gpu-check
while [ $# -gt 0 ]; do
  case $1 in
    --only) ONLY=$2; shift 2 ;;
    --full) ONLY="$ONLY,suite"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT_DIR=$1; shift ;;
  esac
done
for s in ${ONLY//,/ }; do
  case $s in
    tests|train32k|compile|fusedloss|plain|backends|plans|train128k|blocks|calibrate|suite) ;;
    *) echo "gpu_check.sh: unknown section '$s' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
has_cuda() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
  PY=.venv/bin/python
elif has_cuda python3; then
  PY=python3
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/hdp-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/hdp-site
  fi
  # Installed, the folders are hdp.planner, hdp.attention, ... (pyproject.toml's package-dir);
  # without installing, links lay them out the same way.
  tree=/tmp/hdp-tree
  rm -rf "$tree" && mkdir -p "$tree/hdp"
  for f in hdp/*; do ln -s "$PWD/$f" "$tree/hdp/"; done
  for d in attention planner dataloader launch; do ln -s "$PWD/$d" "$tree/hdp/$d"; done
  export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no CUDA GPU visible to .venv/bin/python or python3: nothing to check"; exit 1
fi
# The device's torch may be older than the one the project is tested with on CPU: print the
# schemas of the private attention ops the backends call, for the log.
$PY - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
for op in ("_flash_attention_forward", "_flash_attention_backward",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"):
    print(getattr(torch.ops.aten, op).default._schema)
EOF

wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
declare -a summary
run() {  # run SECONDS NAME COMMAND...: record pass / fail / timeout and the time taken, keep the log
  local limit=$1 name=$2; shift 2
  echo "=== $name: $*"
  local log="$OUT_DIR/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_').log" start=$SECONDS rc
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local took="$((SECONDS - start)) s"
  if [ "$rc" = 0 ]; then summary+=("PASS     $name ($took)")
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then summary+=("TIMEOUT  $name (limit $limit s)")
  else summary+=("FAIL     $name (exit $rc, $took)"); fi
}

if wanted tests; then
  # -P: the repository's hdp/ folder, first on the path from the working directory, would hide
  # the laid-out namespace (hdp.attention, ...) on a machine where hdp is not installed.
  run 240 "GPU kernel, cuDNN backend and dist_attn tests" $PY -P -m pytest -q -rs -p no:cacheprovider \
    tests/test_kernels.py tests/test_cudnn_backend.py tests/test_dist_attn.py -k "gpu or cuda"
fi
# One rank on CUDA with hdp's defaults: NCCL process group, no FSDP (one rank has nothing to
# shard), bf16 autocast, compiled layers, the auto-selected attention backend in dist_attn, the
# fewest recomputed layers that fit (the plain and minimal loops recompute every layer); then
# measured / predicted of every step (the target: 0.9-1.1 after the first two); then on the same
# batches, each with its tokens/s and MFU printed beside hdp's: the minimal loop
# (scripts/minimal_llama.py: torch alone, as a user writes it) and, where the plain section is
# named, the plain packed-sequence loop (hdp's model, one varlen call per layer).
train() {  # train SEQ TOKENS WORKLOAD STEPS
  local seq=$1 tokens=$2 workload=$3 steps=$4
  run 240 "llama-1b training at $seq on CUDA (torchrun, NCCL, bf16)" $PY -m torch.distributed.run \
    --standalone --nproc-per-node 1 launch/pretrain.py --model llama-1b --workload "$workload" \
    --max-seq "$seq" --tokens-per-step "$tokens" --steps "$steps" --warmup 2 \
    --metrics "$OUT_DIR/train_metrics_$seq.jsonl"
  run 30 "measured / predicted at $seq" $PY scripts/bench_fidelity.py metrics \
    "$OUT_DIR/train_metrics_$seq.jsonl"
  local impls=minimal
  wanted plain && impls="hdp minimal"
  for impl in $impls; do
    run 240 "plain loop ($impl model) at $seq beside hdp" $PY scripts/plain_loop.py \
      --impl "$impl" --model llama-1b --workload "$workload" --max-seq "$seq" \
      --tokens-per-step "$tokens" --steps "$steps" --compare "$OUT_DIR/train_metrics_$seq.jsonl"
  done
}
wanted train32k && train 32K 64K wlb-128k 8
# The same run as train32k with one technique changed (--no-compile: eager layers beside the
# compiled default, Note [Compiled layers]; --fused-loss: Liger-Kernel's fused cross-entropy),
# and the median tokens/s of steps 3 on of both side by side.
variant() {  # variant NAME FLAG
  local name=$1 flag=$2
  run 300 "llama-1b training at 32K with $flag" $PY -m torch.distributed.run --standalone \
    --nproc-per-node 1 launch/pretrain.py --model llama-1b --workload wlb-128k --max-seq 32K \
    --tokens-per-step 64K --steps 8 --warmup 2 "$flag" \
    --metrics "$OUT_DIR/train_metrics_32K_$name.jsonl"
  run 30 "$name / defaults tokens/s at 32K" $PY -c '
import json, statistics, sys
rates = []
for path in sys.argv[1:]:
    rows = [json.loads(line) for line in open(path)][2:]
    rates.append(statistics.median(r["tokens"] / r["step_time_s"] for r in rows))
print(f"defaults {rates[0]:,.0f} tokens/s, {sys.argv[2]}: {rates[1]:,.0f} ({rates[1] / rates[0]:.3f}x)")
' "$OUT_DIR/train_metrics_32K.jsonl" "$OUT_DIR/train_metrics_32K_$name.jsonl"
}
wanted compile && variant eager --no-compile
wanted fusedloss && variant fusedloss --fused-loss
# Each attention backend's forward and backward TFLOP/s on the shard shapes, side by side.
if wanted backends; then
  run 180 "attention backends on shard shapes, head_dim 128" $PY scripts/bench_attention.py \
    --backends --head-dim 128
fi
# One rank's attention from real 1024-rank plans, run with the project's kernels (target: 0.9-1.1).
if wanted plans; then
  run 120 "attention of real plans, measured / predicted" $PY scripts/bench_fidelity.py attention \
    --gpus 1024 --backends torch_flash --device cuda
fi
wanted train128k && train 128K 128K byted-2m 5
if wanted blocks; then
  run 120 "block-size benchmark" $PY scripts/bench_attention.py --gpu
  run 180 "attention backends on shard shapes, head_dim 64" $PY scripts/bench_attention.py \
    --backends --head-dim 64
fi
# The cost model against this GPU: its kernel tables measured here, the shipped h100 profile and
# the measured one checked against the measured H100 tables.
if wanted calibrate; then
  run 300 "hdp-calibrate measure (CUDA)" $PY -P -m hdp.launch.calibrate measure --out "$OUT_DIR/profile.json"
  for table in hdp/data/measured/h100_measured.csv hdp/data/measured/h100_cudnn_measured.csv; do
    [ -f "$table" ] || continue
    run 60 "hdp-calibrate check h100 $(basename "$table")" $PY -P -m hdp.launch.calibrate check h100 \
      --table "$table"
    [ -f "$OUT_DIR/profile.json" ] && run 60 "hdp-calibrate check measured $(basename "$table")" \
      $PY -P -m hdp.launch.calibrate check "$OUT_DIR/profile.json" --table "$table"
  done
fi
# The CPU suite under this machine's torch (a CUDA build): the gloo paths must not pick up the GPU.
# Six workers fit one device call (one worker takes over 20 minutes); -v names each failure in the
# log as it happens, so a run cut short by the lease still says what failed.
if wanted suite; then
  run 540 "whole test suite" $PY -P -m pytest -v -rfE -p no:cacheprovider -p no:benchmark \
    -n 6 --dist loadfile --timeout 300 --junitxml "$OUT_DIR/suite.xml" tests
fi
{
  echo
  echo "Summary ($(date -u +%Y-%m-%d), $($PY -c 'import torch; print(torch.cuda.get_device_name())')):"
  printf '  %s\n' "${summary[@]}"
} | tee "$OUT_DIR/summary.txt"
[[ "${summary[*]}" != *FAIL* && "${summary[*]}" != *TIMEOUT* ]]

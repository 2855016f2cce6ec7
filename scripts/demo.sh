#!/usr/bin/env bash
# Install hdp into ./.venv (CPU PyTorch) and run the simulator on a bundled workload:
# every strategy on global batches of byted-2m (2M context) for llama-7b on 1024 H100s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh dev
mkdir -p out
.venv/bin/hdp-sim --workload byted-2m --gpus 1024 --max-seq 2M --model llama-7b \
  --json out/byted-2m-1024.json --plot out/byted-2m-1024.png "$@"

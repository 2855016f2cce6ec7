#!/usr/bin/env bash
# Create ./.venv (if missing) and install hdp into it with the extras given (default: dev).
# torch is pinned to the CPU build that lies on disk here: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev}
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# Checkouts before the hdp-llm name installed this project as "hdp", with its own console scripts.
if .venv/bin/python -m pip show hdp 2>/dev/null | grep -qx "Editable project location: $PWD"; then
  .venv/bin/python -m pip uninstall -q -y hdp
fi
.venv/bin/python -m pip install -q -e ".[$extras]"

#!/usr/bin/env bash
# Install hdp with its test extras into ./.venv (CPU PyTorch) and run the test suite.
# This is the README's test command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch pinned to the CPU build that lies on disk here; an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,megatron]"
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"

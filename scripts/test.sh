#!/usr/bin/env bash
# Install hdp with its test extras into ./.venv (CPU PyTorch), check style with ruff, run the tests.
# This is the README's test command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh dev,megatron
.venv/bin/ruff format --check --diff .
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"

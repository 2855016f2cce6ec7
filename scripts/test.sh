#!/usr/bin/env bash
# Install hdp with its test extras into ./.venv (CPU PyTorch), check style with ruff, check the
# built wheel in a fresh venv (scripts/check_wheel.sh), run the tests.
# This is the README's test command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh dev,megatron
.venv/bin/ruff format --check --diff .
.venv/bin/ruff check .
PYTHON=.venv/bin/python bash scripts/check_wheel.sh
set +e
# Two workers, one test file each at a time: most tests wait on process start-up and gloo, so
# two cores do nearly twice the work; files keep their module fixtures on one worker. A line
# per test file as it ends (tests/conftest.py), the slowest tests at the end.
.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations 15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"

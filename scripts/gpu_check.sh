#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one command, with a summary at the end.
# Run on a machine with a CUDA GPU from the repository root (installs into ./.venv if needed):
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  python3 -m venv .venv && .venv/bin/python -m pip install -q --upgrade pip
  # On a GPU machine take the CUDA build of torch that is installed or available there.
  .venv/bin/python -m pip install -q -e ".[dev]"
fi
declare -a summary
run() {  # run NAME COMMAND...: record pass/fail
  local name=$1; shift
  echo "=== $name: $*"
  if "$@"; then summary+=("PASS  $name"); else summary+=("FAIL  $name"); fi
}
$PY - <<'PY' || { echo "no CUDA GPU visible: nothing to check"; exit 1; }
import torch, sys
assert torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY
run "GPU kernel and dist_attn tests" $PY -m pytest -q -rs tests/test_kernels.py tests/test_dist_attn.py -k "gpu or cuda"
run "block-size benchmark (bench_attention --gpu)" $PY scripts/bench_attention.py --gpu
echo
echo "Summary ($(date -u +%Y-%m-%d), $($PY -c 'import torch; print(torch.cuda.get_device_name())')):"
printf '  %s\n' "${summary[@]}"
[[ "${summary[*]}" != *FAIL* ]]

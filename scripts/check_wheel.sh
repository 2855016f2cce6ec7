#!/usr/bin/env bash
# Build hdp's wheel, install it into a fresh virtual environment outside the repository, and run
# the installed commands from there: the package must work without the checkout beside it and
# must put only `hdp` on the import path. Part of scripts/test.sh (the README's test command).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/hdp-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
step() { echo "check_wheel: $*"; }

# The files git tracks or would track (what a clean clone holds, and new files not yet committed).
step "copying the sources to $work/src"
mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
  xargs -0 cp --parents -t "$work/src")
step "building the wheel"
"$python" -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/*.whl)
step "installing $(basename "$wheel") into a fresh venv (torch 2.13.0, CPU)"
"$python" -m venv "$work/venv"
bin="$work/venv/bin"
"$bin/python" -m pip install -q "torch==2.13.0"
"$bin/python" -m pip install -q "$wheel"

cd "$work"  # nothing of the checkout on the path from here
site=$("$bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for name in planner attention dataloader launch; do
  if [ -e "$site/$name" ] || [ -e "$site/$name.py" ]; then
    echo "check_wheel: the wheel installed a top-level '$name' into site-packages" >&2
    exit 1
  fi
done
step "importing hdp's packages"
"$bin/python" -c "import hdp.planner, hdp.attention, hdp.dataloader, hdp.launch.cli; print(hdp.__version__)"
step "hdp-sim on a bundled workload"
"$bin/hdp-sim" --workload wlb-128k --gpus 64 --steps 1 --strategies static,hdp | tail -3
step "a 2-step CPU hdp-train"
OMP_NUM_THREADS=1 "$bin/hdp-train" --model tiny --steps 2 --tokens-per-step 4K --max-seq 1K \
  --device cpu | tail -1
for command in hdp-export hdp-plan hdp-data hdp-calibrate; do
  "$bin/$command" --help >/dev/null
done
step "passed"

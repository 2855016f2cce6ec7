"""Every plan on the planner benchmark's grid is the one recorded in tests/data/plan_hashes.json.

A change that should not change plans (a refactor) must keep these. A change meant to change
plans records them again (``python scripts/plan_hashes.py --write tests/data/plan_hashes.json``)
and says which plans moved, and why, in its commit message.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "data" / "plan_hashes.json").read_text())


def _script(name: str):
    """``scripts/NAME.py`` as the module ``name`` (plan_hashes imports its sibling bench_planner,
    as it does when run from scripts/)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_script("bench_planner")
plan_hashes = _script("plan_hashes")

CASES = sorted({tuple(key.split("/")[:2]) for key in RECORDED})


@pytest.mark.parametrize("model,workload", CASES)
def test_plans_are_the_recorded_ones(model, workload):
    gpus = sorted({int(key.split("/")[2]) for key in RECORDED})
    got = plan_hashes.grid_hashes([model], gpus, [workload], plan_hashes.STRATEGIES)
    changed = {key: (RECORDED.get(key), h) for key, h in got.items() if RECORDED.get(key) != h}
    assert not changed, f"plans changed (recorded -> now): {changed}"

"""The architecture rules, checked on the source: small modules and functions, layers that import
one way, and a core that loads without torch. (ruff checks formatting and lint in scripts/test.sh.)
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("hdp", "attention", "planner", "dataloader", "launch")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# Each package and the packages it may import, lowest layer first.
LAYERS = {
    "hdp": set(),
    "attention": {"hdp"},
    "planner": {"hdp"},
    "dataloader": {"hdp", "planner"},
    "launch": {"hdp", "attention", "planner", "dataloader"},
}


def _modules(packages):
    for package in packages:
        yield from sorted((ROOT / package).rglob("*.py"))


def _first_party_imports(path: Path) -> set[str]:
    """Top-level first-party packages ``path`` imports anywhere (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & set(LAYERS)
    return found


@pytest.mark.parametrize("path", list(_modules(LIBRARY)), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_are_small(path):
    source = path.read_text()
    assert source.count("\n") <= MAX_MODULE_LINES, f"{path.name}: split it into smaller modules"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


@pytest.mark.parametrize("package", list(LAYERS))
def test_layers_import_one_way(package):
    wrong = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules([package])
        for name in _first_party_imports(path) - LAYERS[package] - {package}
    }
    assert not wrong, "imports against the layering: " + "; ".join(sorted(wrong))


def test_the_core_loads_without_torch():
    # The planner's ground (plans, costs, specs, workloads) must stay usable where torch is not
    # installed: the simulator runs on a laptop.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import hdp, hdp.plan, hdp.cost, hdp.specs, hdp.workloads\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr

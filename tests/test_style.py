"""The architecture rules, checked on the source: small modules and functions, layers that import
one way, and a core that loads without torch. (ruff checks formatting and lint in scripts/test.sh.)
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The repository's folders and the packages they install as (pyproject.toml's package-dir).
FOLDERS = {
    "hdp": "hdp",
    "attention": "hdp.attention",
    "planner": "hdp.planner",
    "dataloader": "hdp.dataloader",
    "launch": "hdp.launch",
}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# Each layer and the layers it may import, lowest first. "hdp" is the core: every module of the
# hdp package outside the sub-packages below.
LAYERS = {
    "hdp": set(),
    "attention": {"hdp"},
    "planner": {"hdp"},
    "dataloader": {"hdp", "planner"},
    "launch": {"hdp", "attention", "planner", "dataloader"},
    "testing": {"hdp", "attention", "planner", "dataloader", "launch"},
}
# Modules that must not sit on an import circle: the config and the core types are leaves that
# every layer above reads.
LEAVES = ("hdp.launch.config", "hdp.specs")


def _modules(folders=FOLDERS):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    """The dotted name ``path`` installs as."""
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    if rest[-1] == "__init__":
        rest = rest[:-1]
    return ".".join([FOLDERS[folder], *rest])


def _layer(module: str) -> str | None:
    """The layer of an hdp module (``None`` outside hdp)."""
    parts = module.split(".")
    if parts[0] != "hdp":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "hdp"


def _imports(path: Path) -> set[str]:
    """The dotted names ``path`` imports anywhere (function level and type checking too), a
    ``from x import y`` as ``x.y``, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # only in the library's modules
                name = _module_name(path)
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _first_party_imports(path: Path) -> set[str]:
    """The layers ``path`` imports."""
    return {layer for name in _imports(path) if (layer := _layer(name)) is not None}


@pytest.mark.parametrize("path", list(_modules()), ids=lambda p: str(p.relative_to(ROOT)))
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


@pytest.mark.parametrize("layer", list(LAYERS))
def test_layers_import_one_way(layer):
    wrong = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules()
        if _layer(_module_name(path)) == layer
        for name in _first_party_imports(path) - LAYERS[layer] - {layer}
    }
    assert not wrong, "imports against the layering: " + "; ".join(sorted(wrong))


def test_one_namespace():
    # Installed, the parts are hdp.planner, hdp.attention, ...: a bare ``planner`` would import
    # whatever else owns that name (Note in pyproject.toml).
    bare = {f.split("/")[-1] for f in FOLDERS if f != "hdp"}
    sources = [*_modules(), *sorted((ROOT / "tests").rglob("*.py"))]
    sources += sorted((ROOT / "scripts").glob("*.py"))
    wrong = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources
        for name in _imports(path)
        if name.split(".")[0] in bare
    }
    assert not wrong, "imports outside the hdp namespace: " + "; ".join(sorted(wrong))


def _import_graph() -> dict[str, set[str]]:
    """hdp's modules and the hdp modules each imports (``from package import name`` counts as
    the module ``package.name`` where that is one, else as ``package``)."""
    paths = {_module_name(path): path for path in _modules()}
    graph = {}
    for name, path in paths.items():
        deps = set()
        for imported in _imports(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    return graph


def _circle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """One import circle from ``start`` back to it, or ``None``."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for dep in sorted(graph[module]):
            if dep == start:
                return [*path, start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, [*path, dep]))
    return None


@pytest.mark.parametrize("leaf", LEAVES)
def test_no_import_circle_through_the_leaves(leaf):
    circle = _circle_through(_import_graph(), leaf)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_core_loads_without_torch():
    # The planner's ground (plans, costs, specs, workloads) must stay usable where torch is not
    # installed: the simulator runs on a laptop.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import hdp, hdp.plan, hdp.cost, hdp.specs, hdp.workloads\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr

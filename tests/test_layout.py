"""The package's layout: one module per phase, no import cycle between modules, and no two
layers (a phase folder, or a top-level module) that import each other.

Function-level imports count: a cycle hidden in a function body is still two modules that
cannot be understood, tested or replaced one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tile_pass

PACKAGE = Path(tile_pass.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The tile_pass modules ``path`` imports anywhere in its body."""
    found = set()
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [base]).strip(".")
            # ``from package import submodule`` imports the submodule, not the package's names
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "tile_pass":
                found.add(name)
    found.discard(_module_name(path))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return path[path.index(imported) :] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def layer_of(module: str) -> str:
    """A module's layer: its folder under the package (``match``, ``program``, ``plan``, ``splice``,
    ``tiles``, ``inspection``, ``integrations``), or a top-level module on its own (two of those that
    import each other are a module cycle, which :func:`find_cycle` reports)."""
    return module.split(".")[1] if module.count(".") else module


def layer_pairs(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Every pair of layers that import each other (sorted), with the imports each way."""
    across: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, imported in graph.items():
        for other in imported:
            if layer_of(module) != layer_of(other):
                across.setdefault((layer_of(module), layer_of(other)), []).append((module, other))
    return {(a, b): sorted(across[a, b] + across[b, a]) for a, b in across if a < b and (b, a) in across}


#: Layer pairs still allowed to import each other: none since the IR's vocabulary (the op facts,
#: TokenReduction) moved into program/ and _distributed stopped reading match/ (issue 44).
#: Nothing is to be added here.
STILL_IMPORTING_EACH_OTHER: set[tuple[str, str]] = set()


def test_no_two_layers_import_each_other():
    pairs = layer_pairs(import_graph())
    found = {pair: imports for pair, imports in pairs.items() if pair not in STILL_IMPORTING_EACH_OTHER}
    assert not found, "layers that import each other: " + "; ".join(
        f"{a} <-> {b} ({', '.join(f'{m} -> {o}' for m, o in imports)})" for (a, b), imports in found.items()
    )
    gone = STILL_IMPORTING_EACH_OTHER - pairs.keys()
    assert not gone, f"no longer importing each other, remove from STILL_IMPORTING_EACH_OTHER: {gone}"


def test_the_layer_check_finds_a_pair_of_folders_importing_each_other():
    graph = {
        "tile_pass.plan._plan": {"tile_pass.tiles._tile_kernel", "tile_pass._settings"},
        "tile_pass.tiles._tile_kernel": {"tile_pass._caches"},
        "tile_pass.tiles.tiled_region": {"tile_pass.plan._plan"},  # no module cycle, yet a pair
        "tile_pass._settings": set(),
        "tile_pass._caches": set(),
    }
    assert find_cycle(graph) is None
    assert layer_pairs(graph) == {
        ("plan", "tiles"): [
            ("tile_pass.plan._plan", "tile_pass.tiles._tile_kernel"),
            ("tile_pass.tiles.tiled_region", "tile_pass.plan._plan"),
        ]
    }
    graph["tile_pass.tiles.tiled_region"] = set()
    assert layer_pairs(graph) == {}


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_function_level_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    # function-level imports are read too
    assert "tile_pass.program._region" in graph["tile_pass.tiles.tiled_region"]


def test_the_docs_pipeline_table_is_generated_from_the_tree():
    """docs/how_it_works.md's table is what scripts/pipeline_table.py makes of the folders' and modules'
    docstrings, and every top-level module or folder is in a row of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "pipeline_table", PACKAGE.parent / "scripts" / "pipeline_table.py"
    )
    pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)
    assert pipeline.unplaced() == [], "place these in scripts/pipeline_table.py's TOP_LEVEL"
    assert pipeline.in_docs() == pipeline.table(), "run: python scripts/pipeline_table.py --write"

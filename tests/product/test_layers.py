"""The tree shows the architecture (docs/architecture.md): each folder of ``otel_rl/`` is a layer,
and a layer imports only the layers below it, at module level or inside a function alike; and no
module imports one that imports it back (an import circle), whichever layer they are in."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Bottom to top. ``sources`` are the folders that bring data into a run; ``logger`` is the
#: facade module, ``otel_rl/__init__.py`` names it lazily.
LAYERS = (
    "core", "process", "delivery", "telemetry", "exporters", "sources", "analysis", "timeline",
    "config", "run", "logger", "compat", "cli",
)  # fmt: skip
SOURCES = frozenset({"distributed", "ray", "rollout", "watch"})


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "otel_rl" or len(parts) < 2:
        return None
    return "sources" if parts[1] in SOURCES else parts[1] if parts[1] in LAYERS else None


def _modules() -> list[tuple[str, Path]]:
    found = [("otel_rl.exporters." + p.stem, p) for p in (ROOT / "exporters").glob("*.py")]
    for path in (ROOT / "otel_rl").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "exporters" not in parts:  # a link to exporters/ in a source checkout
            found.append((".".join(parts), path))
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every name ``path`` imports: by an import statement, or by ``importlib.import_module`` (or
    ``__import__``) of a name written out."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [(node.lineno, node.module)]
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and _names_a_module(node):
            names += [(node.lineno, node.args[0].value)]
    return names


def _names_a_module(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return (
        name in ("import_module", "__import__")
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    )


def test_every_module_of_otel_rl_is_in_a_layer():
    loose = [name for name, _ in _modules() if _layer(name) is None]
    assert sorted(loose) == ["otel_rl.__init__"], "a module outside every layer folder"


def test_no_layer_imports_one_above_it():
    upward = []
    for name, path in _modules():
        here = _layer(name)
        if here is None:
            continue
        for line, imported in _imports(path):
            there = _layer(imported)
            if there is not None and LAYERS.index(there) > LAYERS.index(here):
                where = f"{path.relative_to(ROOT)}:{line}"
                upward.append(f"{where} ({here}) imports {imported} ({there})")
    assert upward == []


@pytest.mark.parametrize("folder", ["benchmarks", "testkit"])
def test_benchmarks_and_the_test_kit_never_import_the_tests(folder):
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in (ROOT / folder).rglob("*.py")
        for line, imported in _imports(path)
        if imported == "tests" or imported.startswith("tests.")
    ]
    assert found == []


#: The most lines a class of ``delivery/`` may hold: a reader holds one part of the delivery at
#: a time (the queue, the spool feeder, the tracker worker, each end of the delivery process).
DELIVERY_CLASS_LINES = 300


def test_no_class_of_the_delivery_layer_is_over_300_lines():
    large = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in sorted((ROOT / "otel_rl" / "delivery").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and (node.end_lineno or node.lineno) - node.lineno + 1 > DELIVERY_CLASS_LINES
    ]
    assert large == []


def _import_graph() -> dict[str, dict[str, str]]:
    """Each module of otel_rl and the modules of otel_rl it imports, each with where (the first
    import of it; a package stands for its ``__init__``)."""
    modules = dict(_modules())

    def module_of(imported: str) -> str | None:
        while imported:
            if imported in modules:
                return imported
            if f"{imported}.__init__" in modules:
                return f"{imported}.__init__"
            imported = imported.rpartition(".")[0]
        return None

    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, imported in _imports(path):
            there = module_of(imported)
            if there is not None and there != name:
                edges.setdefault(there, f"{path.relative_to(ROOT)}:{line}")
    return graph


def _circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected sets of two modules or more (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for there in graph[module]:
            if there not in index:
                visit(there)
                low[module] = min(low[module], low[there])
            elif there in stack:
                low[module] = min(low[module], index[there])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _way_round(circle: list[str], graph: dict[str, dict[str, str]]) -> str:
    """One path round the circle from its first module back to it, each import with its place."""
    start = circle[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for there in sorted(graph[module]):
            if there == start:
                way = paths[module] + [start]
                steps = [f"{a} ({graph[a][b]})" for a, b in itertools.pairwise(way)]
                return " -> ".join(steps) + f" -> {start}"
            if there in circle and there not in paths:
                paths[there] = paths[module] + [there]
                queue.append(there)
    return ", ".join(circle)


def test_no_module_of_otel_rl_imports_one_that_imports_it_back():
    """Each module imports only downward: no import circle, counting imports inside functions
    (they run, later) and ``importlib.import_module`` of a name written out."""
    graph = _import_graph()
    assert [_way_round(circle, graph) for circle in _circles(graph)] == []


def test_no_class_name_is_defined_twice_in_the_product():
    """A class name says one thing: a reader who meets ``Wait`` or ``Stall`` knows which one."""
    where: dict[str, list[str]] = {}
    for _, path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {name: places for name, places in where.items() if len(places) > 1} == {}
    assert len(where) > 100  # the walk found the product's classes

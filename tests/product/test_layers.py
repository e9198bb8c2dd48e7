"""The tree shows the architecture (docs/architecture.md): each folder of ``otel_rl/`` is a layer,
and a layer imports only the layers below it, at module level or inside a function alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Bottom to top. ``sources`` are the folders that bring data into a run; ``logger`` is the
#: facade module, ``otel_rl/__init__.py`` names it lazily.
LAYERS = (
    "core", "process", "delivery", "telemetry", "exporters", "sources", "config", "run", "logger",
    "compat", "cli",
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
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [(node.lineno, node.module)]
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
    return names


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

"""The library's layers, enforced: an import may point down or sideways, never up, and no set of
modules imports itself around a circle. Imports inside functions count: a lazy import hides a cycle
from Python's loader, not from the reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "dynamicrubric"

# Lowest first. A top-level package or module belongs to exactly one layer; a new one must be placed here.
LAYERS: dict[str, tuple[str, ...]] = {
    "infrastructure": ("infra", "store"),
    "engines": ("engines",),
    "tasks": ("tasks",),
    "scoring": ("scoring",),
    "evaluation": ("evaluation",),
    "training": ("training",),
    "stages": ("stages", "components", "pipelines"),
    "local run": ("localrun",),
    "command line": ("cli", "cli_errors"),
}
LAYER_OF = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
SOURCES = {
    **{
        # a package's __init__ is the package itself (engines), a module is folder.module (engines.base)
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
        if p.parent != PACKAGE or p.stem != "__init__"
    },
    **{
        f"{folder}.{p.stem}": p
        for folder in ("components", "pipelines")
        for p in (ROOT / folder).glob("*.py")
    },
}


def _layer_key(module: str) -> str:
    return module.split(".")[0]


def imports_of(path: Path) -> set[str]:
    """The project modules `path` imports anywhere in its body, as keys of SOURCES."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dynamicrubric"):
            parts = node.module.split(".")[1:]
            candidates = [".".join(parts)] if parts else []
            candidates += [".".join([*parts, a.name]) for a in node.names]
            found.update(c for c in candidates if c in SOURCES)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = ".".join(alias.name.split(".")[1:])
                if alias.name.startswith("dynamicrubric.") and name in SOURCES:
                    found.add(name)
    return found


GRAPH = {module: imports_of(path) - {module} for module, path in SOURCES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert sorted(m for m in SOURCES if _layer_key(m) not in LAYER_OF) == []


def test_no_import_points_up():
    upward = [
        f"{m} ({_name(m)}) imports {d} ({_name(d)})"
        for m, deps in GRAPH.items()
        for d in deps
        if LAYER_OF[_layer_key(d)] > LAYER_OF[_layer_key(m)]
    ]
    assert upward == []


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def _name(module: str) -> str:
    return list(LAYERS)[LAYER_OF[_layer_key(module)]]


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
    ],
)
def test_the_cycle_finder_finds_a_circle_and_only_a_circle(graph, expected):
    assert cycles(graph) == expected


def test_a_function_level_import_counts(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n    from dynamicrubric.training.grpo import train_policy\n    from dynamicrubric.infra import tracking\n"
    )
    assert imports_of(source) == {"training.grpo", "infra", "infra.tracking"}

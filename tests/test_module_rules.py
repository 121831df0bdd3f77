"""Two rules that replace a line count: a module's `_names` are its own (another module that needs one
gets a public name, so the dependency is visible and the name says what it is), and a module over 600
lines says at its top why it stays whole (a cut must fall where a concept ends, not where a count does).
Both read the source, so they run in milliseconds."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_NAME = "dynamicrubric"
SOURCES = sorted((ROOT / "src" / PACKAGE_NAME).rglob("*.py")) + sorted((ROOT / "components").glob("*.py"))
MAX_LINES = 600
WHOLE_REASON = "stays whole"  # the phrase a long module's docstring uses to say why


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_names(tree: ast.Module) -> dict[str, str]:
    """The local names bound to one of the package's modules: `import dynamicrubric.x.y as y`,
    `from dynamicrubric.x import y` (y a module or package), and the full dotted name itself."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE_NAME:
                    names[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE_NAME:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                path = ROOT / "src" / Path(*dotted.split("."))
                if path.with_suffix(".py").is_file() or path.is_dir():
                    names[alias.asname or alias.name] = dotted
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def private_crossings(path: Path) -> list[str]:
    """'file:line module._name' for every private name of another of the package's modules that `path`
    imports or reads as an attribute of that module."""
    tree = ast.parse(path.read_text(), str(path))
    modules = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE_NAME:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = _dotted(node.value)
            if owner in modules:
                found.append((node.lineno, f"{modules[owner]}.{node.attr}"))
    rel = path.relative_to(ROOT)
    return [f"{rel}:{line} {name}" for line, name in sorted(found)]


def test_no_module_uses_another_modules_private_name():
    crossings = [c for path in SOURCES for c in private_crossings(path)]
    assert crossings == [], f"{len(crossings)} private names cross a module boundary:\n" + "\n".join(
        crossings
    )


def test_a_module_over_600_lines_says_at_its_top_why_it_stays_whole():
    unexplained = []
    for path in SOURCES:
        text = path.read_text()
        lines = text.count("\n") + 1
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if WHOLE_REASON not in doc.lower():
            unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert unexplained == [], (
        f"over {MAX_LINES} lines without a reason in the module docstring ('{WHOLE_REASON}: ...'): "
        + ", ".join(unexplained)
    )


def test_the_rules_see_what_they_forbid(tmp_path):
    """Both ways of reaching a private name are found, and a module's own or a public one is not."""
    probe = ROOT / "src" / PACKAGE_NAME / "_rules_probe.py"
    probe.write_text(
        "import dynamicrubric.store.s3 as s3\n"
        "from dynamicrubric.store import folders\n"
        "from dynamicrubric.scoring.aggregate import _hidden, aggregate\n"
        "def _mine(): return s3._secret, folders.publish_version, _mine\n"
    )
    try:
        assert [c.split(" ")[1] for c in private_crossings(probe)] == [
            "dynamicrubric.scoring.aggregate._hidden",
            "dynamicrubric.store.s3._secret",
        ]
    finally:
        probe.unlink()

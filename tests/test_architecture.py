"""The package's layering, read from the source with ``ast`` (no imports run, no devices, well under a second).

See docs/architecture.md for the packages these rules protect.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megasparse"
MAX_LINES = 450
TRAIN_MAX_LINES = 350
LONG_REASON = "Why this file is long:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """megasparse modules that ``name`` imports anywhere in its file (top level or inside functions)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import submodule`` imports the submodule; ``from pkg import name`` the package itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            # the longest known module the dotted name lies in
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None.

    Edges are the imports written in the files; the implicit run of ``pkg/__init__`` when ``pkg.mod`` is
    imported is not an edge (a package exporting its submodules would otherwise cycle with each of them)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def importers(prefix: str, forbidden: str) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, deps in GRAPH.items()
        if m == prefix or m.startswith(prefix + ".")
        for t in deps
        if t == forbidden or t.startswith(forbidden + ".")
    )


def test_graph_is_read():
    # guards the checks below against passing vacuously: known edges must be found
    assert len(MODULES) > 40
    assert "megasparse.ops.compact" in GRAPH["megasparse.ops.rowwise"]
    assert "megasparse.configbase" in GRAPH["megasparse.config"]


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_parallel_imports_no_loss():
    assert importers("megasparse.parallel", "megasparse.loss") == []


def test_ops_imports_no_sparse24():
    assert importers("megasparse.ops", "megasparse.sparse24") == []


def has_long_reason(path: Path) -> bool:
    text = path.read_text(encoding="utf-8")
    head = text.splitlines()[:40]
    if any(line.startswith("# " + LONG_REASON) for line in head):
        return True
    doc = ast.get_docstring(ast.parse(text)) or ""
    return any(par.strip().startswith(LONG_REASON) for par in doc.split("\n\n"))


def test_long_files_say_why():
    long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in MODULES.values()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES and not has_long_reason(p)
    ]
    assert long == [], f"over {MAX_LINES} lines without a '{LONG_REASON}' note at the top: {long}"


def test_train_is_a_composer():
    n = len((PKG / "train.py").read_text(encoding="utf-8").splitlines())
    assert n <= TRAIN_MAX_LINES, f"megasparse/train.py has {n} lines (at most {TRAIN_MAX_LINES})"


def test_torchtitan_stays_in_the_benchmarks():
    """torchtitan is a benchmark anchor (the [bench] extra, decision 0504): the package never imports it."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            mods += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{name} imports {m}" for m in mods if m.split(".")[0] == "torchtitan"]
    assert found == []

"""The package's layering, read from the source with ``ast`` (no imports run, no devices, well under a second).

See docs/architecture.md for the packages these rules protect.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megasparse"
MAX_LINES = 450
TRAIN_MAX_LINES = 260
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


# -- the step's shape (issue 31, decision 0013) ---------------------------------------------------------------------
LAYER_FILES = ["megasparse.parallel.layers", "megasparse.parallel.rows", "megasparse.parallel.vocab"]
"""Modules below the model that get their process groups passed in (with every ``megasparse.ops`` module)."""


def _layer_modules() -> list[str]:
    ops = [m for m in MODULES if m == "megasparse.ops" or m.startswith("megasparse.ops.")]
    assert len(ops) > 5 and all(m in MODULES for m in LAYER_FILES)
    return LAYER_FILES + ops


def test_layers_get_their_process_groups_passed_in():
    """No read of the global layout below the model: the TP group arrives with the layer (``parallel/groups.py``)."""
    reads = [f"{m} imports {t}" for m in _layer_modules() for t in GRAPH[m] if t == "megasparse.parallel.state"]
    assert reads == []
    assert "megasparse.parallel.groups" in GRAPH["megasparse.parallel.layers"]  # the check reads what it should


def _functions_talking_without_a_group(path: Path) -> list[str]:
    """Autograd Functions whose methods call ``comm.*`` but whose ``forward`` takes no group argument."""
    bad = []
    for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(cls, ast.ClassDef) or not any(ast.unparse(b).endswith("Function") for b in cls.bases):
            continue
        calls = [
            n
            for n in ast.walk(cls)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and ast.unparse(n.func).startswith("comm.")
        ]
        fwd = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        args = {a.arg for a in fwd.args.args} if fwd is not None else set()
        if calls and not args & {"pg", "group", "tp_group"}:
            bad.append(f"{path.name}:{cls.name}")
    return bad


def test_autograd_functions_receive_their_group(tmp_path):
    assert _functions_talking_without_a_group(PKG / "parallel" / "layers.py") == []
    assert _functions_talking_without_a_group(PKG / "parallel" / "vocab.py") == []
    # the check finds a Function that talks over a group it reads from elsewhere
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class F(torch.autograd.Function):\n    def forward(ctx, x):\n        comm.all_reduce(x, g, 'tp')\n",
        encoding="utf-8",
    )
    assert _functions_talking_without_a_group(sample) == ["sample.py:F"]


def test_cudagraph_asks_components_instead_of_knowing_them():
    """Each feature says why it cannot be captured (``capture_blocker()``); cudagraph imports none of them."""
    for feature in ("megasparse.filtering", "megasparse.sparse24", "megasparse.loss"):
        assert importers("megasparse.cudagraph", feature) == []
    for owner, cls in [
        ("filtering/component.py", "TokenFilter"),
        ("sparse24/converter.py", "Sparse24Converter"),
        ("loss/pipeline.py", "VocabOverPP"),
        ("parallel/dist_optim.py", "DistributedAdamW"),
        ("fp8/converter.py", "Fp8Converter"),
    ]:
        tree = ast.parse((PKG / owner).read_text(encoding="utf-8"))
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        assert "capture_blocker" in {f.name for f in node.body if isinstance(f, ast.FunctionDef)}, cls


VOCAB_PP_WIRING = {"lookup_all", "backward_all", "caught", "VocabPPPeer", "VocabOverPP", "lockstep", "vocab_peer"}


def test_train_has_no_schedule_or_vocab_over_pp_wiring():
    """The trainer composes the step (``megasparse/step/``); the schedules and the vocabulary over PP are not in it."""
    tree = ast.parse((PKG / "train.py").read_text(encoding="utf-8"))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert names & VOCAB_PP_WIRING == set()
    assert "megasparse.parallel.pipeline" not in GRAPH["megasparse.train"]
    assert {"megasparse.step.executor", "megasparse.step.build"} <= GRAPH["megasparse.train"]


def test_one_schedule_signature():
    """``get_schedule`` returns schedules that all take (num_mb, p2p, step, in_flight, slot)."""
    tree = ast.parse((PKG / "step" / "schedule.py").read_text(encoding="utf-8"))
    sigs = {
        c.name: [a.arg for a in f.args.args]
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "__call__"
    }
    assert set(sigs) >= {"OneFOneB", "Interleaved", "LockStep", "ForwardOnly"}
    assert {tuple(v) for v in sigs.values()} == {("self", "num_mb", "p2p", "step", "in_flight", "slot")}


def test_torchtitan_stays_in_the_benchmarks():
    """torchtitan is a benchmark anchor (the [bench] extra, decision 0504): the package never imports it."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            mods += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{name} imports {m}" for m in mods if m.split(".")[0] == "torchtitan"]
    assert found == []

"""The package's import graph: no module of kvfence/ reaches itself through its imports (any
import counts: at the top, in a function, or for type checking only), and the core (engine, kv,
model) imports no role (kvfence.pd). Read from the source with ast: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = ("kvfence.engine", "kvfence.kv", "kvfence.model")
ROLE = "kvfence.pd"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in (root / "kvfence").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        return [base, *(f"{base}.{a.name}" for a in node.names)]
    return []


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Each kvfence module -> the kvfence modules it imports (a `from pkg import name` counts
    as pkg, and as pkg.name when that is a module)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, package):
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each holds an import cycle)."""
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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


def test_no_module_of_kvfence_imports_itself_through_others() -> None:
    assert cycles(import_graph()) == []


def test_the_core_imports_no_role() -> None:
    graph = import_graph()
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        if any(_in(mod, core) for core in CORE)
        for dep in deps
        if _in(dep, ROLE)
    )
    assert bad == []


def test_twin_the_checks_see_a_planted_cycle_and_a_planted_role_import(tmp_path: Path) -> None:
    """The same checks on a tree with one cycle and one core -> role import find both."""
    files = {
        "kvfence/__init__.py": "",
        "kvfence/engine/__init__.py": "",
        "kvfence/engine/core.py": "from kvfence.pd.role import Role\n",
        "kvfence/pd/__init__.py": "",
        "kvfence/pd/role.py": "def f():\n    from kvfence.pd import other\n",
        "kvfence/pd/other.py": "from .role import f\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["kvfence.pd.other", "kvfence.pd.role"]]
    assert "kvfence.pd.role" in graph["kvfence.engine.core"]

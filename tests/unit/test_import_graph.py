"""The import graph of ``src/shardwise`` has no cycle: every import statement counts, also one
inside a function (a lazy import) or under ``if TYPE_CHECKING``."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import shardwise

PACKAGE = Path(shardwise.__file__).resolve().parent
ROOT = "shardwise"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _target(
    node: ast.ImportFrom, name: str, here: str, is_pkg: bool, known: dict[str, Path]
) -> str:
    """The module a ``from X import name`` loads: X.name when that is a module, else X."""
    if node.level:
        base = here.split(".") if is_pkg else here.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return f"{source}.{name}" if f"{source}.{name}" in known else source


FACADE_ENTRIES = {("shardwise", "shardwise.cli.finetune_cmd")}
"""Imports left out of the graph: ``shardwise.finetune(...)`` runs the app's command, importing
it inside the function, when called; importing the library never imports the app."""


def import_graph() -> dict[str, set[str]]:
    """module -> the shardwise modules its import statements load (anywhere in the file), but
    for ``FACADE_ENTRIES``."""
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [_target(node, a.name, mod, is_pkg, known) for a in node.names]
            else:
                continue
            for t in targets:
                if (t == ROOT or t.startswith(ROOT + ".")) and t in known and t != mod:
                    if (mod, t) not in FACADE_ENTRIES:
                        graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
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
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_in(graph: dict[str, set[str]], scc: list[str]) -> list[str]:
    """One concrete cycle through the component's first module, for the failure message."""
    start, members = scc[0], set(scc)
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        if start in nxt and len(path) > 1:
            return [*path, start]
        step = next((n for n in nxt if n not in seen), None)
        if step is None:
            return [*path, start]
        path.append(step)
        seen.add(step)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    graph = import_graph()
    assert "shardwise.comm.ops" in graph["shardwise.comm.facade"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(_path_in(graph, scc)) for scc in found
    )


def test_dist_is_a_leaf() -> None:
    assert import_graph()["shardwise.dist"] == set()


APP = ("cli", "train")
"""The app: the commands and the train loop. The library never imports them."""


def _package(module: str) -> str:
    """The top-level subpackage of ``module`` (a module at the root is its own node)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _parallel_child(module: str) -> str | None:
    """``parallel.X`` for a module inside the subpackage ``parallel/X/``, else None."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "parallel":
        return f"parallel.{parts[2]}"
    is_pkg = _modules().get(module, Path()).name == "__init__.py"
    return f"parallel.{parts[2]}" if len(parts) == 3 and parts[1] == "parallel" and is_pkg else None


def package_graph(node_of: Callable[[str], str | None]) -> dict[str, set[str]]:
    """The module graph collapsed onto ``node_of``'s nodes (modules mapped to None left out)."""
    out: dict[str, set[str]] = {}
    for mod, targets in import_graph().items():
        a = node_of(mod)
        if a is None:
            continue
        out.setdefault(a, set())
        for t in targets:
            b = node_of(t)
            if b is not None and b != a:
                out[a].add(b)
                out.setdefault(b, set())
    return out


def test_the_library_never_imports_the_app() -> None:
    offenders = sorted(
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        if _package(m) not in APP
        for t in targets
        if _package(t) in APP
    )
    assert not offenders, f"library modules import the app ({'/'.join(APP)}): {offenders}"


def test_no_package_cycle_between_top_level_packages() -> None:
    graph = package_graph(_package)
    found = cycles(graph)
    assert not found, "package cycles:\n" + "\n".join(
        " -> ".join(_path_in(graph, scc)) for scc in found
    )


def test_no_package_cycle_between_parallel_subpackages() -> None:
    graph = package_graph(_parallel_child)
    assert {"parallel.pipeline", "parallel.tensor", "parallel.plans"} <= set(graph)
    found = cycles(graph)
    assert not found, "cycles between parallel's subpackages:\n" + "\n".join(
        " -> ".join(_path_in(graph, scc)) for scc in found
    )


def test_the_facade_reaches_the_app_only_when_called() -> None:
    import subprocess
    import sys

    app = ("shardwise.cli", "shardwise.train")
    code = f"import sys, shardwise; print([m for m in sys.modules if m.startswith({app})])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert callable(shardwise.finetune)

"""Below the public facade nothing treats a missing group as the world: library modules take
their Group, Mesh or World as an argument. Only the entry points listed here may resolve None to
the current world, once, for their caller."""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

PACKAGE = Path(shardwise.__file__).resolve().parent
APP = ("cli", "train")  # the app's commands form and name their world; not the library
FACADE_FILES = {"__init__.py", "comm/__init__.py", "comm/facade.py", "comm/current_world.py"}
ENTRY_POINTS = {
    ("engine/initialize.py", "initialize"),
    ("mesh.py", "Mesh.__init__"),
    ("zero/wrap.py", "zero_wrap"),
    ("topology/discover.py", "discover"),
}
"""(file, function): the public entry points that may resolve None to the current world."""
CURRENT_WORLD_READS = {"resolve", "current", "rank", "world_size", "local_rank", "device"}
"""``comm.current_world`` functions that read the current world (``init``/``attach`` form one)."""
WORLD_NAMES = ("group", "world", "mesh")
NONE_MEANS_NONE = {
    ("zero/step.py", "sharded_step", "overflow_group"),  # no group beyond the norm's
    ("parallel/plans/gpt.py", "loss", "mesh"),  # no mesh: the plain, unsplit loss
}
"""Parameters whose None means "no such group", never the world."""


class _Finder(ast.NodeVisitor):
    def __init__(self, source: str) -> None:
        self.found: list[tuple[str, str]] = []  # (function, what)
        self.scope: list[str] = []
        self.current_world: set[str] = set()  # local names of the module comm.current_world
        self.readers: set[str] = set()  # names imported from it (or from comm) that read it
        self.dist: set[str] = set()  # local names of shardwise.dist
        self.comm: set[str] = set()  # local names of shardwise.comm
        self.visit(ast.parse(source))

    def _where(self) -> str:
        return ".".join(self.scope) or "<module>"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            local = a.asname or a.name
            full = f"{node.module}.{a.name}"
            if full == "shardwise.comm.current_world":
                self.current_world.add(local)
            elif full == "shardwise.dist":
                self.dist.add(local)
            elif full == "shardwise.comm":
                self.comm.add(local)
            elif node.module in ("shardwise.comm.current_world", "shardwise.comm"):
                if a.name in CURRENT_WORLD_READS or a.name == "world":
                    self.readers.add(local)

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._check_defaults(node)
        self._scoped(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._check_defaults(node)
        self._scoped(node)

    def _check_defaults(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args
        pos = args.posonlyargs + args.args
        pairs = list(zip(pos[len(pos) - len(args.defaults) :], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        for arg, default in pairs:
            named = any(w in arg.arg for w in WORLD_NAMES)
            is_none = isinstance(default, ast.Constant) and default.value is None
            if named and is_none:
                where = ".".join([*self.scope, node.name])
                self.found.append((where, f"parameter {arg.arg}=None"))

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        what = None
        if isinstance(f, ast.Name) and f.id in self.readers:
            what = f.id
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            base, attr = f.value.id, f.attr
            if base in self.current_world and attr in CURRENT_WORLD_READS:
                what = f"{base}.{attr}"
            elif base in self.dist and attr in ("rank", "world_size"):
                what = f"{base}.{attr}"  # torch's default group
            elif base in self.comm and attr in ("resolve", "current", "world"):
                what = f"{base}.{attr}"
        if what is not None:
            self.found.append((self._where(), f"{what}()"))
        self.generic_visit(node)


def implicit_worlds(source: str, rel: str = "") -> list[str]:
    """Where ``source`` treats a missing group as the world: calls that read the current world
    or torch's default group, and group/world/mesh parameters defaulting to None."""
    out = []
    for where, what in _Finder(source).found:
        if (rel, where) in ENTRY_POINTS:
            continue
        if what.startswith("parameter ") and (rel, where, what.split()[1][:-5]) in NONE_MEANS_NONE:
            continue
        out.append(f"{where}: {what}")
    return out


def test_the_check_finds_implicit_worlds() -> None:
    src = (
        "from shardwise import comm\nfrom shardwise import dist as sw_dist\n"
        "from shardwise.comm.current_world import current\n"
        "from shardwise.comm import current_world\n"
        "def f(x, group: Group | None = None):\n    return comm.resolve(group)\n"
        "class A:\n    def g(self):\n        return current().rank + sw_dist.world_size()\n"
        "def h(*, world=None):\n    return current_world.device()\n"
        "def fine(group: Group, n: int | None = None):\n    return comm.ops\n"
    )
    assert implicit_worlds(src) == [
        "f: parameter group=None",
        "f: comm.resolve()",
        "A.g: current()",
        "A.g: sw_dist.world_size()",
        "h: parameter world=None",
        "h: current_world.device()",
    ]


def test_no_implicit_world_below_the_facade() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in FACADE_FILES or rel.split("/")[0] in APP:
            continue
        found = implicit_worlds(path.read_text(), rel)
        if found:
            offenders[rel] = found
    assert not offenders, (
        f"library code treats a missing group as the world: {offenders}; take the Group, Mesh "
        "or World as an argument (only the public entry points resolve None)"
    )

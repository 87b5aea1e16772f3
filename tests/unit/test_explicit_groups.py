"""Inside the library every collective names its group: library modules call ``comm.ops``,
``comm.objects`` and ``comm.mpi_split`` (group required) and never the public facade, where a
forgotten ``group=`` would silently mean the whole world."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise import comm
from shardwise.comm import facade, mpi_split, objects, ops

PACKAGE = Path(shardwise.__file__).resolve().parent
# The facade itself, and the package's re-exports of it.
FACADE_HOMES = {
    PACKAGE / "__init__.py",
    PACKAGE / "comm" / "__init__.py",
    PACKAGE / "comm" / "facade.py",
}
FACADE_NAMES = {
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_list",
    "reduce_scatter",
    "all_to_all",
    "send",
    "recv",
    "barrier",
    "broadcast_object",
    "all_gather_object",
    "new_group",
    "split",
    "comm_stats",
    "exposed_comm_seconds",
    "set_debug",
}
FACADE_MODULES = {"shardwise", "shardwise.comm", "shardwise.comm.facade"}


def facade_calls(source: str) -> list[str]:
    """``name`` for each call of a facade function in ``source``: ``comm.all_reduce(...)``,
    ``shardwise.broadcast(...)``, or a name imported from the facade and called."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> facade module
    imported: dict[str, str] = {}  # local name -> facade function
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in FACADE_MODULES:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in FACADE_MODULES:
                    aliases[a.asname or a.name] = full
                elif node.module in FACADE_MODULES and a.name in FACADE_NAMES:
                    imported[a.asname or a.name] = a.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in FACADE_NAMES:
            base = ast.unparse(f.value)
            if base in aliases:
                found.append(f"{base}.{f.attr}")
        elif isinstance(f, ast.Name) and f.id in imported:
            found.append(f.id)
    return found


def test_the_check_finds_facade_calls() -> None:
    src = (
        "import shardwise\nfrom shardwise import comm\n"
        "from shardwise.comm import all_reduce as ar\nfrom shardwise.comm import ops\n"
        "comm.all_reduce(t)\nshardwise.broadcast(t, group=g)\nar(t)\nops.all_reduce(t, group=g)\n"
    )
    assert facade_calls(src) == ["comm.all_reduce", "shardwise.broadcast", "ar"]


def test_library_modules_call_no_facade_collective() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in FACADE_HOMES:
            continue
        calls = facade_calls(path.read_text())
        if calls:
            offenders[str(path.relative_to(PACKAGE))] = calls
    assert not offenders, (
        f"library code calls the public facade (group=None means the world): {offenders}; "
        "call shardwise.comm.ops / objects / mpi_split with an explicit group"
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: ops.all_reduce(torch.ones(2), group=None),  # type: ignore[call-overload]
        lambda: ops.broadcast(torch.ones(2), group=None),  # type: ignore[call-overload]
        lambda: ops.all_gather(torch.ones(2), group=None),  # type: ignore[call-overload]
        lambda: ops.reduce_scatter(torch.ones(2), group=None),  # type: ignore[call-overload]
        lambda: ops.barrier(group=None),  # type: ignore[arg-type]
        lambda: objects.all_gather_object(1, group=None),  # type: ignore[arg-type]
        lambda: mpi_split.split(0, group=None),  # type: ignore[arg-type]
    ],
)
def test_library_entry_points_refuse_a_missing_group(call) -> None:
    with pytest.raises(TypeError, match="group must be a shardwise Group"):
        call()


def test_library_entry_points_have_no_default_group() -> None:
    import inspect

    for fn in (
        ops.all_reduce,
        ops.broadcast,
        ops.all_gather,
        ops.reduce_scatter,
        ops.all_to_all,
        ops.send,
        ops.recv,
        ops.barrier,
        ops.all_gather_list,
        ops.all_reduce_coalesced,
        objects.broadcast_object,
        objects.all_gather_object,
        mpi_split.split,
    ):
        group = inspect.signature(fn).parameters["group"]
        assert group.default is inspect.Parameter.empty, fn.__name__
        assert group.kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
    assert inspect.signature(comm.all_reduce).parameters["group"].default is None
    assert inspect.signature(facade.broadcast).parameters["group"].default is None


OPS_COLLECTIVES = set(ops.__all__) - {"P2P_ALL_GATHER_MIN_BYTES", "Handle", "chunk_sizes"}


def ops_calls_without_group(source: str) -> list[str]:
    """``ops.X(...)`` calls (``ops`` imported from ``shardwise.comm``) that pass no ``group=``:
    the shared signatures type ``group`` as optional, so this check, not mypy, keeps library
    code naming its group."""
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "shardwise.comm":
            names |= {a.asname or a.name for a in node.names if a.name == "ops"}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if f.attr in OPS_COLLECTIVES and ast.unparse(f.value) in names:
            if not any(k.arg == "group" for k in node.keywords):
                found.append(f"{ast.unparse(f.value)}.{f.attr} (line {node.lineno})")
    return found


def test_the_check_finds_ops_calls_without_a_group() -> None:
    src = "from shardwise.comm import ops\nops.all_reduce(t)\nops.send(t, 1, group=g)\n"
    assert ops_calls_without_group(src) == ["ops.all_reduce (line 2)"]


def test_library_calls_to_ops_name_their_group() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        calls = ops_calls_without_group(path.read_text())
        if calls:
            offenders[str(path.relative_to(PACKAGE))] = calls
    assert not offenders, f"ops collectives called without group=: {offenders}"

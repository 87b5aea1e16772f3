"""all_reduce by a chosen algorithm, run from the counted point-to-point ops.

``ops.all_reduce(t, op, group=..., algorithm=...)`` (``shardwise.comm.all_reduce`` with the
group optional): ``"native"`` (the default) is the backend's own; ``"ring"``,
``"halving_doubling"``, ``"tree"`` and ``"hierarchical"`` run the schedules of
``shardwise.comm.allreduce_rounds`` over ``send``/``recv`` (``run``); ``"auto"`` picks the one with
the least predicted time from the measured links (``links=``, e.g.
``shardwise.topology.discover(group).links()``; the public facade measures them itself, see
``comm.links``) and the message size.

Every rank ends with the same bits (each element is reduced on one rank, then copied), equal to
native for integer sums and within floating-point rounding otherwise. ``comm_stats()`` counts
one ``all_reduce`` of the tensor's bytes per call, plus the algorithm's messages as
``send``/``recv`` (their bytes are the wire traffic the algorithm costs).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.comm import allreduce_rounds, emulate
from shardwise.comm.allreduce_rounds import GroupLinks, Transfer
from shardwise.comm.dispatch import Handle, launch, nbytes
from shardwise.comm.gloo_exchange import combine, finish_avg
from shardwise.comm.groups import Group
from shardwise.comm.send_recv import recv, send

ALGORITHMS = ("native", *allreduce_rounds.ALGORITHMS, "auto")


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce: unknown algorithm {algorithm!r}; allowed: {ALGORITHMS}")


def run(
    t: torch.Tensor,
    op: str,
    g: Group,
    async_op: bool,
    algorithm: str,
    nodes: Sequence[int] | None,
    links: GroupLinks | None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """``ops.all_reduce`` by a schedule (any algorithm but native), its arguments checked.

    The algorithms run to completion before returning; the handle of ``async_op`` is already
    complete. ``nodes``: for ``"hierarchical"``, the node of each group rank (any ints);
    default from ``links``, else from the environment (``SHARDWISE_EMULATE_NODES`` or
    torchrun's node-major layout). ``links``: the group's measured links, needed by ``"auto"``.
    """
    layout = _layout(g, nodes, links, algorithm)
    if algorithm == "auto":
        if links is None:
            raise ValueError(
                "all_reduce: algorithm='auto' needs links= (the group's measured links, e.g. "
                "shardwise.topology.discover(group).links())"
            )
        algorithm = allreduce_rounds.choose(nbytes(t), t.element_size(), links)
    flat = t.view(-1)

    def issue() -> list[object]:
        run_schedule(
            flat, g, allreduce_rounds.schedule(algorithm, flat.numel(), g.size, layout), op
        )
        return []

    return launch(
        "all_reduce",
        g,
        [t],
        nbytes(t),
        issue,
        lambda: finish_avg(t, op, g.size),
        async_op,
        f"op={op}, algorithm={algorithm}, ",
    )


def _layout(
    g: Group, nodes: Sequence[int] | None, links: GroupLinks | None, algorithm: str
) -> tuple[int, ...] | None:
    """Each group rank's node (hierarchical only; None for the flat algorithms)."""
    if nodes is not None:
        layout = tuple(int(x) for x in nodes)
        if len(layout) != g.size:
            raise ValueError(
                f"all_reduce: nodes= has {len(layout)} entries; {g} has {g.size} ranks"
            )
        return layout
    if links is not None:
        if len(links.nodes) != g.size:
            raise ValueError(f"all_reduce: links= describes {len(links.nodes)} ranks, not {g.size}")
        return links.nodes
    if algorithm != "hierarchical":
        return None
    world = emulate.env_nodes(g.world.world_size)
    if world is None:
        raise ValueError(
            "all_reduce: algorithm='hierarchical' needs the nodes: pass nodes= or links=, or set "
            f"{emulate.NODES_ENV}"
        )
    return tuple(world[r] for r in g.ranks)


_scratch = threading.local()


def _receive_buffer(like: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of this thread's receive buffer for ``like``'s dtype and device, kept
    between calls: a fresh buffer of many MiB costs a page fault per page on its first touch,
    which made large all_reduces a third slower than their bytes."""
    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = getattr(_scratch, "buffers", {})
    _scratch.buffers = buffers
    key = (like.dtype, like.device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def run_schedule(
    flat: torch.Tensor, g: Group, rounds: Sequence[allreduce_rounds.Round], op: str
) -> None:
    """Play this rank's part of ``rounds`` on ``flat`` (a contiguous 1-D tensor)."""
    me = g.rank
    need = max((x.hi - x.lo for r in rounds for x in r if x.dst == me and x.reduce), default=0)
    scratch = _receive_buffer(flat, need) if need else None
    for rnd in rounds:
        out = [x for x in rnd if x.src == me]
        inc = [x for x in rnd if x.dst == me]
        assert len(out) <= 1 and len(inc) <= 1, "a round sends and receives at most once per rank"
        if not out and not inc:
            continue
        handles: list[Handle[Any]] = []
        target = flat[:0]
        if inc:
            x = inc[0]
            if x.reduce:
                assert scratch is not None
                target = scratch[: x.hi - x.lo]
            else:
                target = flat[x.lo : x.hi]
                assert not out or not _overlap(x, out[0]), "a copy may not land on what is sent"
            handles.append(recv(target, g.ranks[x.src], group=g, async_op=True))
        if out:
            x = out[0]
            handles.append(send(flat[x.lo : x.hi], g.ranks[x.dst], group=g, async_op=True))
        for h in handles:
            h.wait()
        if inc and inc[0].reduce:
            x = inc[0]
            local = flat[x.lo : x.hi]
            combine(op, local, target, local)


def _overlap(a: Transfer, b: Transfer) -> bool:
    return a.lo < b.hi and b.lo < a.hi

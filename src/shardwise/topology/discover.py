"""``discover``: every rank's place and every link's measured alpha-beta, on every rank."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from shardwise.comm import GroupLike, World, emulate, objects, resolve
from shardwise.topology import measure, probe
from shardwise.topology.model import RankInfo, Topology


def local_info(world: World) -> RankInfo:
    """This rank's node, CPUs, NUMA nodes and device in ``world`` (no communication)."""
    rank = world.rank
    cpus = probe.cpu_affinity()
    emulated = bool(os.environ.get(emulate.NODES_ENV))
    device = world.device
    gpu, bus, links = "", "", dict[str, str]()
    if device.type == "cuda":
        gpu, bus, links = probe.gpu_facts(device.index or 0)
    return RankInfo(
        rank=rank,
        node=probe.node_name(rank, world.world_size),
        host=socket.gethostname(),
        # emulated nodes: the launcher's LOCAL_RANK describes the real machine; number anew
        local_rank=-1 if emulated else int(os.environ.get("LOCAL_RANK", "-1")),
        cpus=cpus,
        numa_nodes=probe.numa_nodes(cpus),
        device=str(device),
        gpu_name=gpu,
        pci_bus_id=bus,
        gpu_links=links,
    )


def _fill_local_ranks(infos: list[RankInfo]) -> list[RankInfo]:
    """Where the launcher gave no LOCAL_RANK, number the ranks of each node in rank order."""
    seen: dict[str, int] = {}
    out = []
    for r in infos:
        index = seen.setdefault(r.node, 0)
        seen[r.node] = index + 1
        out.append(r if r.local_rank >= 0 else RankInfo(**{**r.__dict__, "local_rank": index}))
    return out


def discover(
    group: GroupLike = None, sizes: Sequence[int] = measure.DEFAULT_SIZES, reps: int = 10
) -> Topology:
    """Where every rank of ``group`` (default: the world) runs and how fast each pair talks.

    Collective: every rank of the group calls it and gets the same ``Topology`` (ranks in group
    order). Each pair of ranks ping-pongs messages of ``sizes`` bytes (``reps`` round trips each,
    one pair at a time) and the one-way times are fitted to ``alpha + bytes * beta``.

    Communicates: one all_gather_object of the rank facts, then ``measure_links``' traffic.
    """
    g = resolve(group)
    infos = objects.all_gather_object(local_info(g.world), group=g)
    measured = measure.measure_links(g, sizes, reps)
    fits, samples = measure.link_matrix(g.size, sizes, measured)
    return Topology(
        ranks=tuple(_fill_local_ranks(infos)),
        sizes=tuple(sizes),
        fits=tuple(tuple(row) for row in fits),
        samples=tuple(tuple(row) for row in samples),
    )

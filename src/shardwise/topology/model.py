"""What discovery found, as plain values: each rank's place and every link's alpha-beta fit."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardwise.comm.allreduce_rounds import GroupLinks, LinkCost


@dataclass(frozen=True)
class RankInfo:
    """Where one rank runs."""

    rank: int
    node: str  # torchrun's node (GROUP_RANK), an emulated node, else the host name
    host: str
    local_rank: int
    cpus: tuple[int, ...]  # CPU affinity
    numa_nodes: tuple[int, ...]  # NUMA nodes of those CPUs (empty when the OS does not say)
    device: str  # "cpu" or "cuda:N"
    gpu_name: str = ""
    pci_bus_id: str = ""
    # GPU links from this GPU to others by PCI bus id: "NV<k>" (NVLink), "PIX", "PHB", "SYS"...
    gpu_links: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LinkFit:
    """A link's fitted one-way time ``alpha_s + bytes * beta_s_per_byte`` and the fit's R²."""

    alpha_s: float
    beta_s_per_byte: float
    r2: float

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    def cost(self) -> LinkCost:
        return LinkCost(self.alpha_s, self.beta_s_per_byte)


@dataclass(frozen=True)
class Topology:
    """Ranks, their nodes and the measured link between every pair of ranks.

    ``fits[i][j]`` (None on the diagonal) is the alpha-beta fit of ranks i and j; ``samples``
    holds the measured one-way seconds per message size behind it.
    """

    ranks: tuple[RankInfo, ...]
    sizes: tuple[int, ...]
    fits: tuple[tuple[LinkFit | None, ...], ...]
    samples: tuple[tuple[tuple[float, ...] | None, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def node_ids(self) -> tuple[int, ...]:
        """Each rank's node as a small int, numbered in order of first appearance."""
        ids: dict[str, int] = {}
        return tuple(ids.setdefault(r.node, len(ids)) for r in self.ranks)

    def islands(self) -> dict[str, list[tuple[int, ...]]]:
        """``{"node": [...], "nvlink": [...]}``: ranks sharing a node, and ranks whose GPUs are
        joined by NVLink (connected components; a rank without NVLink is its own island)."""
        by_node: dict[str, list[int]] = {}
        for r in self.ranks:
            by_node.setdefault(r.node, []).append(r.rank)
        return {"node": [tuple(v) for v in by_node.values()], "nvlink": self._nvlink_islands()}

    def _nvlink_islands(self) -> list[tuple[int, ...]]:
        parent = list(range(self.world_size))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a in self.ranks:
            for b in self.ranks:
                same_node = a.node == b.node and a.rank < b.rank
                if same_node and a.gpu_links.get(b.pci_bus_id, "").startswith("NV"):
                    parent[find(b.rank)] = find(a.rank)
        groups: dict[int, list[int]] = {}
        for r in range(self.world_size):
            groups.setdefault(find(r), []).append(r)
        return [tuple(v) for v in groups.values()]

    def links(self, ranks: tuple[int, ...] | None = None) -> GroupLinks:
        """The alpha-beta model of a group (global ``ranks`` in group order; default all) for
        the all_reduce cost prediction: the median fit of same-node pairs and of cross-node
        pairs (one stands in for the other when a kind is absent). Between CPU processes of one
        node the link is half-duplex (``LinkCost.duplex``: the bytes go through their cores);
        links across nodes are network links, duplex."""
        ranks = tuple(range(self.world_size)) if ranks is None else tuple(ranks)
        ids = self.node_ids()
        intra: list[LinkFit] = []
        inter: list[LinkFit] = []
        for i, a in enumerate(ranks):
            for b in ranks[i + 1 :]:
                fit = self.fits[a][b]
                assert fit is not None
                (intra if ids[a] == ids[b] else inter).append(fit)
        if not intra and not inter:
            same = LinkCost(0.0, 0.0)
            return GroupLinks(tuple(ids[r] for r in ranks), same, same)
        on_cpu = all(self.ranks[r].device == "cpu" for r in ranks)
        intra_c = _median(intra or inter, duplex=not (on_cpu and intra))
        return GroupLinks(tuple(ids[r] for r in ranks), intra_c, _median(inter or intra))

    def min_r2(self) -> float:
        values = [f.r2 for row in self.fits for f in row if f is not None]
        return min(values) if values else 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        ranks = tuple(
            RankInfo(**{**r, "cpus": tuple(r["cpus"]), "numa_nodes": tuple(r["numa_nodes"])})
            for r in d["ranks"]
        )
        fits = tuple(tuple(None if f is None else LinkFit(**f) for f in row) for row in d["fits"])
        samples = tuple(tuple(None if s is None else tuple(s) for s in row) for row in d["samples"])
        return cls(ranks, tuple(d["sizes"]), fits, samples)

    @classmethod
    def read_json(cls, path: str | Path) -> Topology:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _median(fits: list[LinkFit], duplex: bool = True) -> LinkCost:
    return LinkCost(
        statistics.median(f.alpha_s for f in fits),
        statistics.median(f.beta_s_per_byte for f in fits),
        duplex,
    )

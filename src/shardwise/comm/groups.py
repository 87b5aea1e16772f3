"""A world of ranks and the groups formed in it, as values.

A ``World`` is one process's view of one set of ranks: its rank, the world size, the backend and
timeout, torch's process group that joins them, and what the ranks said to each other (the
``CommStats`` counters and the ``Tracer`` flight recorder). A ``Group`` is a subset of a world's
ranks; it carries the world it belongs to and the counters its collectives record into, so a
collective needs nothing but its group.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.comm import local_group
from shardwise.comm.allreduce_rounds import GroupLinks
from shardwise.comm.stats import CommStats
from shardwise.comm.trace import Tracer, debug_from_env

_names = itertools.count()


class World:
    """One process's place in a world of ranks, and the state of its communication.

    Build it with ``shardwise.init()`` (which forms or adopts torch's default process group), or
    directly over a process group for a world within a process.

    Args:
        rank: this process's rank in the world.
        world_size: number of ranks.
        local_rank: this process's rank on its node.
        backend: "gloo", "nccl" or "mpi".
        timeout_s: default seconds a collective of this world may wait.
        pg: torch's process group of all ranks (None with one rank and no torch group).
        owns_pg: True when shardwise formed ``pg`` and must destroy it when the world ends.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        backend: str,
        timeout_s: float,
        pg: ProcessGroup | None,
        owns_pg: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world size {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.owns_pg = owns_pg
        self.stats = CommStats()
        self.tracer = Tracer(rank)
        self.debug: bool | None = None  # None: follow SHARDWISE_DEBUG_COLLECTIVES
        self._links: list[_Link] = []
        self._pg_link = self._link(pg)
        # Measured links by group ranks, for the public all_reduce's "auto" (``comm.links``).
        self.measured_links: dict[tuple[int, ...], GroupLinks] = {}
        # Groups formed on first use, by (sorted ranks, timeout): torch names such a group by
        # a hash of its ranks and refuses a second one, so meshes over the same ranks share it.
        self._on_use: dict[tuple[tuple[int, ...], float], _Link] = {}
        self._forming = threading.Lock()
        self.group = Group(
            self._pg_link,
            tuple(range(world_size)),
            "world",
            self.timeout_s,
            self,
            self.stats,
        )

    @property
    def pg(self) -> ProcessGroup | None:
        """torch's process group of all ranks (None with one rank and no torch group)."""
        return self._pg_link.pg

    def _link(self, pg: ProcessGroup | None) -> _Link:
        link = _Link(pg, registered=pg is not None and local_group.is_live(pg))
        self._links.append(link)
        return link

    def release(self) -> list[ProcessGroup]:
        """End this world's hold on torch's process groups: every group of it refuses further
        collectives, and the distinct torch groups they held are returned, so that the caller's
        dropping them is what destroys them (once torch's registry let go of them too)."""
        held: dict[int, ProcessGroup] = {}
        for link in self._links:
            if link.pg is not None:
                held[id(link.pg)] = link.pg
            link.pg, link.form, link.released = None, None, True
        return list(held.values())

    def debug_enabled(self) -> bool:
        """Whether collectives of this world check that every rank issues the same call."""
        return debug_from_env() if self.debug is None else self.debug

    @property
    def device(self) -> torch.device:
        """``cuda:local_rank`` on the nccl backend, else ``cpu``."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def new_group(
        self,
        ranks: list[int] | tuple[int, ...],
        timeout_s: float | None = None,
        name: str | None = None,
        dedicated: bool = False,
        stats: CommStats | None = None,
    ) -> Group:
        """Form a group of the given ranks of this world. Every rank of the world must call it,
        in the same order as every other ``new_group`` (torch's rule).

        Args:
            ranks: distinct ranks; their order is the group-rank order.
            timeout_s: how long a collective in this group may wait; default the world's.
            name: shown in traces and errors.
            dedicated: always form a new torch group, even for all ranks (e.g. for a background
                thread whose collectives must never interleave with the main thread's).
            stats: counters the group's collectives record into (default the world's).
        """
        n = self.world_size
        ranks = tuple(int(r) for r in ranks)
        if not ranks:
            raise ValueError("new_group needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group ranks must be distinct, got {list(ranks)}")
        bad = [r for r in ranks if not 0 <= r < n]
        if bad:
            raise ValueError(f"ranks {bad} are outside the world of {n} ranks (allowed 0..{n - 1})")
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        name = name or f"group{next(_names)}"
        stats = self.stats if stats is None else stats
        if len(ranks) == 1:  # nothing to talk to: no torch group (every rank skips it alike)
            return Group(self._link(None), ranks, name, timeout, self, stats)
        if len(ranks) == n and timeout == self.timeout_s and not dedicated:
            return Group(self._pg_link, ranks, name, timeout, self, stats)
        pg = dist.new_group(sorted(ranks), timeout=datetime.timedelta(seconds=timeout))
        link = self._link(pg if self.rank in ranks else None)
        return Group(link, ranks, name, timeout, self, stats)

    def group_on_use(
        self,
        ranks: list[int] | tuple[int, ...],
        name: str,
        stats: CommStats,
        timeout_s: float | None = None,
    ) -> Group:
        """A group of ``ranks`` whose torch group is formed on its first collective, by its
        members alone (``comm.local_group``): no other rank of the world calls this. Every
        member forms it when it first communicates in it, which they must all do anyway, and
        groups of this world over the same ranks share one torch group. Where groups cannot
        form among their members alone (MPI; a default group bound to a device) every rank of
        the world must call this, in the same order, and the group is formed at once."""
        ranks = tuple(int(r) for r in ranks)
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        whole = len(ranks) == self.world_size and timeout == self.timeout_s
        if len(ranks) == 1 or whole or not local_group.can_form_locally(self.backend):
            return self.new_group(ranks, timeout_s=timeout, name=name, stats=stats)
        if self.rank not in ranks:
            return Group(self._link(None), ranks, name, timeout, self, stats)
        key = (tuple(sorted(ranks)), timeout)
        link = self._on_use.get(key)
        if link is None or (link.pg is not None and not local_group.is_live(link.pg)):
            link = self._on_use[key] = self._link(None)
            link.form = lambda: local_group.form_among_members(key[0], timeout)
        return Group(link, ranks, name, timeout, self, stats)

    def adopt(self, pg: ProcessGroup) -> Group:
        """A group over a torch process group formed elsewhere (its ranks must be this world's)."""
        ranks = tuple(dist.get_process_group_ranks(pg))
        return Group(self._link(pg), ranks, f"pg{next(_names)}", self.timeout_s, self, self.stats)

    def __repr__(self) -> str:
        return (
            f"World(rank={self.rank}, world_size={self.world_size}, backend={self.backend}, "
            f"timeout_s={self.timeout_s:g})"
        )


@dataclass(eq=False)
class _Link:
    """The torch process group behind one or more ``Group``s of a world. ``World.release``
    empties every link: shardwise then holds no reference that would keep a torch group, and
    the worker threads it runs, alive into the interpreter's teardown."""

    pg: ProcessGroup | None
    released: bool = False
    form: Callable[[], ProcessGroup] | None = None  # set: formed on first use (``group_on_use``)
    # ``pg`` is in torch's registry: its leaving it means someone destroyed it under us
    registered: bool = False


@dataclass
class _CallCounter:
    """Collectives issued so far in one group (shared by copies that differ only in debug)."""

    issued: int = 0


@dataclass(frozen=True, eq=False)
class Group:
    """A set of ranks of one world that communicate together.

    ``ranks`` lists world ranks in group-rank order: position i is group rank i. torch orders a
    process group by rank; where ``ranks`` is in another order (``split`` with keys), the
    collectives permute chunks so that chunk i always belongs to group rank i.
    """

    link: _Link = field(repr=False)
    ranks: tuple[int, ...]
    name: str
    timeout_s: float
    world: World = field(repr=False)
    stats: CommStats = field(repr=False)
    debug: bool | None = None  # None: the world's setting
    calls: _CallCounter = field(default_factory=_CallCounter, repr=False)
    p2p_calls: _CallCounter = field(default_factory=_CallCounter, repr=False)  # send / recv
    _torch_order: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_torch_order", tuple(sorted(self.ranks)))

    @property
    def pg(self) -> ProcessGroup | None:
        """torch's process group (None: this rank is not a member, or the group has one rank);
        a group from ``World.group_on_use`` is formed here, on its first collective.

        Raises:
            RuntimeError: the world this group belongs to has ended (``shardwise.shutdown()``).
        """
        if self.link.released:
            raise RuntimeError(
                f"{self!r}: its world has ended (shardwise.shutdown() or the end of the process);"
                " call shardwise.init() and build groups and engines anew"
            )
        if self.link.form is not None:
            with self.world._forming:  # one formation, even with a writer thread beside
                if self.link.form is not None:
                    self.link.pg, self.link.form = self.link.form(), None
                    self.link.registered = True
        pg = self.link.pg
        # destroyed under us: torch itself would only say the group "is not registered"
        if pg is not None and self.link.registered and not local_group.is_live(pg):
            raise RuntimeError(
                f"{self!r}: its torch process group was destroyed (destroy_process_group) while"
                " shardwise still uses it; destroy groups only after the engines and groups"
                " over them are gone, or build those anew"
            )
        return pg

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's group rank, or -1 when it is not a member."""
        me = self.world.rank
        return self.ranks.index(me) if me in self.ranks else -1

    @property
    def is_member(self) -> bool:
        return self.world.rank in self.ranks

    @property
    def tracer(self) -> Tracer:
        return self.world.tracer

    @property
    def permuted(self) -> bool:
        """True when group-rank order differs from torch's (sorted) order."""
        return self.ranks != self._torch_order

    def torch_position(self, group_rank: int) -> int:
        """Where torch puts group rank ``group_rank``'s chunk."""
        return self._torch_order.index(self.ranks[group_rank])

    def debug_enabled(self) -> bool:
        """Whether this group's collectives run the desync check first."""
        return self.world.debug_enabled() if self.debug is None else self.debug

    def with_debug(self, enabled: bool | None) -> Group:
        """The same group (same torch group, counters and call sequence) with the desync check
        on (True), off (False) or following its world (None)."""
        return dataclasses.replace(self, debug=enabled)

    def __repr__(self) -> str:
        return f"Group({self.name}, ranks={list(self.ranks)})"

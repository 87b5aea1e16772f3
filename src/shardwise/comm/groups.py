"""Process groups: the world, explicit rank lists, and MPI_Comm_split."""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import dist as sw_dist

_names = itertools.count()


@dataclass(frozen=True, eq=False)
class Group:
    """A set of ranks that communicate together.

    ``ranks`` lists global ranks in group-rank order: position i is group rank i. torch orders a
    process group by global rank; where ``ranks`` is in another order (``split`` with keys), the
    collectives permute chunks so that chunk i always belongs to group rank i.
    """

    pg: ProcessGroup | None  # None: this rank is not a member, or the group has one rank
    ranks: tuple[int, ...]
    name: str
    timeout_s: float
    _torch_order: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_torch_order", tuple(sorted(self.ranks)))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's group rank, or -1 when it is not a member."""
        me = sw_dist.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    @property
    def is_member(self) -> bool:
        return sw_dist.rank() in self.ranks

    @property
    def permuted(self) -> bool:
        """True when group-rank order differs from torch's (sorted) order."""
        return self.ranks != self._torch_order

    def torch_position(self, group_rank: int) -> int:
        """Where torch puts group rank ``group_rank``'s chunk."""
        return self._torch_order.index(self.ranks[group_rank])

    def __repr__(self) -> str:
        return f"Group({self.name}, ranks={list(self.ranks)})"


_world: Group | None = None


def world() -> Group:
    """The group of every rank (torch's default group)."""
    global _world
    if _world is None or _world.size != sw_dist.world_size():
        n = sw_dist.world_size()
        _world = Group(dist.group.WORLD, tuple(range(n)), "world", sw_dist.timeout_s())
    return _world


def reset_world() -> None:
    """Forget the cached world group (after the process group was re-formed)."""
    global _world
    _world = None


def resolve(group: Group | ProcessGroup | None) -> Group:
    """Accept None (the world), a shardwise Group or a torch ProcessGroup."""
    if group is None:
        return world()
    if isinstance(group, Group):
        return group
    if isinstance(group, ProcessGroup):
        ranks = tuple(dist.get_process_group_ranks(group))
        return Group(group, ranks, f"pg{next(_names)}", sw_dist.timeout_s())
    raise TypeError(
        f"group must be None, a shardwise Group or a torch ProcessGroup, got {type(group).__name__}"
    )


def new_group(
    ranks: list[int] | tuple[int, ...],
    timeout_s: float | None = None,
    name: str | None = None,
    dedicated: bool = False,
) -> Group:
    """Form a group of the given global ranks. Every rank of the world must call it, in the
    same order as every other ``new_group`` (torch's rule).

    Args:
        ranks: distinct global ranks; their order is the group-rank order.
        timeout_s: how long a collective in this group may wait; default the world's timeout.
        dedicated: always form a new torch group, even for all ranks (e.g. for a background
            thread whose collectives must never interleave with the main thread's).
    """
    n = sw_dist.world_size()
    ranks = tuple(int(r) for r in ranks)
    if not ranks:
        raise ValueError("new_group needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group ranks must be distinct, got {list(ranks)}")
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise ValueError(f"ranks {bad} are outside the world of {n} ranks (allowed 0..{n - 1})")
    timeout = sw_dist.timeout_s() if timeout_s is None else float(timeout_s)
    if timeout <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout}")
    name = name or f"group{next(_names)}"
    if len(ranks) == 1:  # nothing to talk to: no torch group (every rank skips it alike)
        return Group(None, ranks, name, timeout)
    if len(ranks) == n and timeout == sw_dist.timeout_s() and not dedicated:
        return Group(dist.group.WORLD, ranks, name, timeout)
    pg = dist.new_group(sorted(ranks), timeout=datetime.timedelta(seconds=timeout))
    return Group(pg if sw_dist.rank() in ranks else None, ranks, name, timeout)


def split(
    color: int | None,
    key: int = 0,
    group: Group | ProcessGroup | None = None,
    timeout_s: float | None = None,
) -> Group | None:
    """MPI_Comm_split: ranks of ``group`` passing the same ``color`` form one new group, ordered
    by ``key`` then by their rank in ``group``. ``color=None`` (MPI_UNDEFINED) joins no group
    and returns None. Every rank of the world must call it (torch forms groups collectively).

    Communicates: one all_gather of two int64 per rank over ``group``.
    """
    import torch

    from shardwise.comm import ops

    parent = resolve(group)
    if color is not None and color < 0:
        raise ValueError(f"color must be >= 0 or None (no group), got {color}")
    members: dict[int, list[tuple[int, int, int]]] = {}
    if parent.is_member:
        mine = torch.tensor([-1 if color is None else color, key], dtype=torch.int64)
        table = ops.all_gather(mine.unsqueeze(0), group=parent).tolist()
        for grank, (c, k) in enumerate(table):
            if c >= 0:
                members.setdefault(c, []).append((k, grank, parent.ranks[grank]))
    # Groups beyond the parent are formed by the whole world; ranks outside the parent learn the
    # layout from the parent's lowest rank so that every rank calls new_group the same times.
    if parent.size != sw_dist.world_size():
        members = ops.broadcast_object(members if parent.rank == 0 else None, src=parent.ranks[0])
    result = None
    for c in sorted(members):
        ordered = tuple(r for _, _, r in sorted(members[c]))
        g = new_group(ordered, timeout_s=timeout_s, name=f"split{c}")
        if sw_dist.rank() in ordered:
            result = g
    return result

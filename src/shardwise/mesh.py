"""The process mesh: named axes over a world, in one declared order, built once.

Axes, outermost first (``AXIS_ORDER``): ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``.
Ranks are laid out row-major in that order, so tensor-parallel peers are neighbours (same node)
and pipeline stages are farthest apart::

    rank = (((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t

``dp`` is the data-parallel axis as one: ``dp_replicate`` x ``dp_shard`` flattened (its rank is
``r * dp_shard + s``). A flat data-parallel mesh has ``dp_replicate = 1`` and ``dp_shard = dp``;
hierarchical sharding (HSDP) splits it, so a shard group is ``dp_shard`` consecutive dp ranks
(one node, with cp and tp inside it) and its replicas are ``dp_shard`` apart.

A new axis is one entry in ``Axis`` and ``AXIS_ORDER``: coordinates, groups and sizes are
generic over the declared axes.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable, Mapping

from shardwise.comm.current_world import current
from shardwise.comm.groups import Group, World
from shardwise.comm.stats import CommStats


class Axis(str, enum.Enum):
    """A mesh axis. A ``str`` enum: ``Axis.TP == "tp"``, so either spelling names it."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    DP = "dp"
    """The data-parallel axis as one: dp_replicate x dp_shard flattened."""

    def __str__(self) -> str:
        return self.value


AXIS_ORDER: tuple[Axis, ...] = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)
"""The mesh's own axes, outermost first (tp innermost: its peers are neighbours)."""

FLATTENED: dict[Axis, tuple[Axis, ...]] = {Axis.DP: (Axis.DP_REPLICATE, Axis.DP_SHARD)}
"""Names for several adjacent axes taken as one."""

ALL_NAMES = ", ".join(a.value for a in (*AXIS_ORDER, *FLATTENED))


def as_axis(name: str | Axis) -> Axis:
    """``name`` as an ``Axis``; ValueError naming the allowed axes for anything else."""
    try:
        return Axis(name)
    except ValueError:
        raise ValueError(f"unknown mesh axis {name!r}; allowed: {ALL_NAMES}") from None


def expand(axes: Iterable[str | Axis]) -> tuple[Axis, ...]:
    """The mesh's own axes that ``axes`` names (``dp`` is dp_replicate and dp_shard), in mesh
    order, each once."""
    own: set[Axis] = set()
    for a in axes:
        axis = as_axis(a)
        own.update(FLATTENED.get(axis, (axis,)))
    return tuple(a for a in AXIS_ORDER if a in own)


def _check_size(name: str, value: object, fill_ok: bool) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"mesh size {name}={value!r} must be an int")
    if value == 0 or value < (-1 if fill_ok else 1):
        allowed = ">= 1 (or -1 to fill the world)" if fill_ok else ">= 1"
        raise ValueError(f"mesh size {name}={value} must be {allowed}")


def resolve_sizes(
    world_size: int,
    *,
    pp: int = 1,
    dp: int = -1,
    dp_replicate: int | None = None,
    dp_shard: int | None = None,
    cp: int = 1,
    tp: int = 1,
) -> dict[Axis, int]:
    """Each own axis's size for a world of ``world_size`` ranks; one of ``pp``, ``dp``, ``cp``,
    ``tp`` may be -1 (fill the world). ``dp`` is split as ``dp_replicate`` x ``dp_shard``
    (flat when neither is given; a missing one follows from the other).

    Raises:
        TypeError / ValueError: naming the size that is wrong and what would work.
    """
    for name, v in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
        _check_size(name, v, fill_ok=True)
    for name, part in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if part is not None:
            _check_size(name, part, fill_ok=False)
    if dp_replicate is not None and dp_shard is not None:
        if dp not in (-1, dp_replicate * dp_shard):
            raise ValueError(
                f"dp={dp} does not match dp_replicate={dp_replicate} x dp_shard={dp_shard} "
                f"= {dp_replicate * dp_shard}; give dp = dp_replicate * dp_shard, or leave "
                "dp out"
            )
        dp = dp_replicate * dp_shard
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"only one mesh axis may be -1 (fill), got {fill}")
    known = math.prod(s for s in sizes.values() if s != -1)
    given = " x ".join(f"{a}={s}" for a, s in sizes.items() if s not in (-1, 1)) or "1"
    if fill:
        if world_size % known:
            raise ValueError(f"world size {world_size} is not divisible by {known} ({given})")
        sizes[fill[0]] = world_size // known
    if math.prod(sizes.values()) != world_size:
        raise ValueError(
            f"mesh {given} = {math.prod(sizes.values())} does not match the world size {world_size}"
        )
    r, s = _dp_split(sizes["dp"], dp_replicate, dp_shard)
    return {
        Axis.PP: sizes["pp"],
        Axis.DP_REPLICATE: r,
        Axis.DP_SHARD: s,
        Axis.CP: sizes["cp"],
        Axis.TP: sizes["tp"],
    }


def _dp_split(dp: int, replicate: int | None, shard: int | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of a resolved dp size; a missing one follows from the other."""
    if replicate is None and shard is None:
        return 1, dp
    known = replicate if replicate is not None else shard
    assert known is not None
    if dp % known:
        name = "dp_replicate" if replicate is not None else "dp_shard"
        raise ValueError(f"{name}={known} does not divide dp={dp}; use a divisor of {dp}")
    r = replicate if replicate is not None else dp // known
    sh = shard if shard is not None else dp // known
    if r * sh != dp:
        raise ValueError(
            f"dp_replicate={replicate} x dp_shard={shard} = {r * sh} does not match dp={dp}; "
            "give dp = dp_replicate * dp_shard (or leave dp out)"
        )
    return r, sh


class Mesh:
    """Named axes over a world; it owns every group along any combination of its axes, and the
    counters (``stats``) that its groups' collectives record into (and into the world's).

    It holds this rank's group along every combination of the axes larger than one (a
    combination that differs only by axes of size one is the same group). Building it costs no
    communication: each group's torch process group is formed on its first collective, by its
    members alone, and meshes over the same ranks share it.

    Args:
        pp, dp, cp, tp: the size of each axis; one of them may be -1 (fill the world).
        dp_replicate, dp_shard: hierarchical sharding (HSDP): ZeRO shards over groups of
            ``dp_shard`` consecutive dp ranks (``group("dp_shard")``) and replicates across the
            ``dp_replicate`` groups (``group("dp_replicate")``); ``dp = dp_replicate *
            dp_shard``. Give both (dp may then be left out), or one to split a given dp.
            Default: flat, ``dp_shard = dp``.
        world: the ranks it spans: a World, a Group of one (a sub-world: mesh rank i is the
            group's rank i; a rank outside the group holds no groups and need not build the
            mesh, except on MPI, where every rank of the world forms every group), or
            the current world (default, ``shardwise.init()``).
        world_size: only check the sizes against this many ranks, forming no groups (a mesh
            that cannot communicate; for planning).
    """

    def __init__(
        self,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        dp_replicate: int | None = None,
        dp_shard: int | None = None,
        world: World | Group | None = None,
        world_size: int | None = None,
    ) -> None:
        if world is None and world_size is None:
            world = current()  # the public entry point: None is the current world, once
        members = None  # the world ranks of mesh ranks 0..n-1 (None: no groups)
        if isinstance(world, Group):
            members, world = world.ranks, world.world
        elif world is not None:
            members = tuple(range(world.world_size))
        n = len(members) if members is not None else world_size
        assert n is not None
        if members is not None and len(members) != n:
            raise ValueError(f"world_size={n} does not match the world's {len(members)} ranks")
        self.axis_sizes = resolve_sizes(
            n, pp=pp, dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp
        )
        self.world_size = n
        if world is None or members is None:  # a plan's mesh: sizes only
            return
        self.world = world
        self.members = members
        self.stats = CommStats(parent=world.stats)
        self._groups: dict[tuple[Axis, ...], Group] = {}
        self.is_member = world.rank in members
        if self.is_member:
            self.coords = self.coords_of(members.index(world.rank))
        self._form_groups()

    # ---- sizes and coordinates -----------------------------------------------------------

    def size(self, *axes: str | Axis) -> int:
        """The number of ranks along ``axes`` together (``size("dp")``, ``size("dp", "tp")``)."""
        return math.prod(self.axis_sizes[a] for a in expand(axes))

    @property
    def sizes(self) -> dict[Axis, int]:
        """Every axis's size, the flattened ``dp`` included."""
        return {**self.axis_sizes, Axis.DP: self.size(Axis.DP)}

    @property
    def dp_size(self) -> int:
        return self.size(Axis.DP)

    @property
    def dp_replicate_size(self) -> int:
        return self.axis_sizes[Axis.DP_REPLICATE]

    @property
    def dp_shard_size(self) -> int:
        return self.axis_sizes[Axis.DP_SHARD]

    @property
    def cp_size(self) -> int:
        return self.axis_sizes[Axis.CP]

    @property
    def tp_size(self) -> int:
        return self.axis_sizes[Axis.TP]

    @property
    def pp_size(self) -> int:
        return self.axis_sizes[Axis.PP]

    def coords_of(self, rank: int) -> dict[Axis, int]:
        """Every axis's coordinate of ``rank`` (the flattened ``dp`` included)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        out: dict[Axis, int] = {}
        for axis in reversed(AXIS_ORDER):
            rank, out[axis] = divmod(rank, self.axis_sizes[axis])
        ordered = {a: out[a] for a in AXIS_ORDER}
        ordered[Axis.DP] = self._flat(ordered, FLATTENED[Axis.DP])
        return ordered

    def _flat(self, coords: Mapping[Axis, int], axes: tuple[Axis, ...]) -> int:
        i = 0
        for a in axes:
            i = i * self.axis_sizes[a] + coords[a]
        return i

    def rank_of(self, coords: Mapping[str | Axis, int] | None = None, **more: int) -> int:
        """The rank at ``coords`` (``mesh.rank_of(pp=1, tp=0)``); an axis left out keeps this
        rank's coordinate. ``dp`` sets dp_replicate and dp_shard together."""
        given = {as_axis(k): v for k, v in {**(coords or {}), **more}.items()}
        c = {a: v for a, v in self.coords.items() if a in AXIS_ORDER}
        for axis, v in given.items():
            if axis in FLATTENED:
                for part in reversed(FLATTENED[axis]):
                    v, c[part] = divmod(v, self.axis_sizes[part])
                continue
            c[axis] = v
        for axis in AXIS_ORDER:
            if not 0 <= c[axis] < self.axis_sizes[axis]:
                raise ValueError(
                    f"{axis}={c[axis]} is outside the mesh's {axis} size {self.axis_sizes[axis]}"
                )
        return self._flat(c, AXIS_ORDER)

    def rank(self, axis: str | Axis) -> int:
        """This rank's coordinate along ``axis`` (its group rank in ``group(axis)``)."""
        return self.coords[as_axis(axis)]

    # ---- groups --------------------------------------------------------------------------

    def partition(self, *axes: str | Axis) -> list[tuple[int, ...]]:
        """Every group of ranks that differ only along ``axes``, each in row-major order."""
        return self._partition(expand(axes))

    def _partition(self, axes: tuple[Axis, ...]) -> list[tuple[int, ...]]:
        fixed = [a for a in AXIS_ORDER if a not in axes]
        out = []
        for fixed_vals in itertools.product(*(range(self.axis_sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = []
            for vals in itertools.product(*(range(self.axis_sizes[a]) for a in axes)):
                ranks.append(self._flat({**base, **dict(zip(axes, vals))}, AXIS_ORDER))
            out.append(tuple(ranks))
        return out

    def _form_groups(self) -> None:
        """This rank's group along every combination of the axes larger than one. Its torch
        group is formed on its first collective, by its members alone
        (``World.group_on_use``), so building a mesh costs no communication and a rank
        outside it need not build it; on MPI every rank forms every group here, in one order."""
        big = [a for a in AXIS_ORDER if self.axis_sizes[a] > 1]
        me = self.world.rank
        everyone = self.world.backend == "mpi"  # no group-local formation there
        if self.is_member:
            self._groups[()] = self.world.new_group([me], name="self", stats=self.stats)
        for k in range(1, len(big) + 1):
            for axes in itertools.combinations(big, k):
                for ranks in self._partition(axes):
                    ranks = tuple(self.members[r] for r in ranks)  # mesh ranks -> world ranks
                    name = "+".join(axes)
                    if everyone:
                        g = self.world.new_group(ranks, name=name, stats=self.stats)
                        if me in ranks:
                            self._groups[axes] = g
                    elif me in ranks:
                        self._groups[axes] = self.world.group_on_use(ranks, name, self.stats)

    def group(self, *axes: str | Axis) -> Group:
        """The group of this rank's peers along ``axes`` (e.g. ``mesh.group("dp", "tp")``,
        ``mesh.group(Axis.DP_SHARD)``), in rank order."""
        if not axes:
            raise ValueError(f"name at least one mesh axis; allowed: {ALL_NAMES}")
        if not self.is_member:
            raise ValueError(f"rank {self.world.rank} is outside this mesh (ranks {self.members})")
        own = expand(axes)
        return self._groups[tuple(a for a in own if self.axis_sizes[a] > 1)]

    def __repr__(self) -> str:
        s = self.axis_sizes
        dp = f"dp={self.dp_size}"
        if self.dp_replicate_size > 1:  # hierarchical: replicas x shard group
            dp += f" ({self.dp_replicate_size} x {self.dp_shard_size})"
        sizes = f"pp={s[Axis.PP]}, {dp}, cp={s[Axis.CP]}, tp={s[Axis.TP]}"
        coords = getattr(self, "coords", None)
        where = "" if coords is None else f", coords={ {str(a): c for a, c in coords.items()} }"
        return f"Mesh({sizes}{where})"

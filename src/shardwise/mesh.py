"""The process mesh: named axes pp x dp x tp over the world, built once.

Ranks are laid out row-major with pp outermost and tp innermost, so tensor-parallel peers are
neighbours (same node) and pipeline stages are farthest apart:
``rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank``.

The dp axis may be split in two (hierarchical sharding, HSDP): ``dp_replicate`` x ``dp_shard``
with ``dp_rank = replicate_rank * dp_shard + shard_rank``, so a shard group is ``dp_shard``
consecutive dp ranks (one node, with tp inside it) and its replicas are ``dp_shard`` apart.
"""

from __future__ import annotations

import itertools

from shardwise.comm.current_world import current
from shardwise.comm.groups import Group, World
from shardwise.comm.stats import CommStats

AXES = ("pp", "dp", "tp")
DP_PARTS = ("dp_replicate", "dp_shard")  # the dp axis split for hierarchical sharding


def _dp_split(dp: int, replicate: int | None, shard: int | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of a resolved dp size; a missing one follows from the other."""
    if replicate is None and shard is None:
        return 1, dp
    given = {"dp_replicate": replicate, "dp_shard": shard}
    known = replicate if replicate is not None else shard
    assert known is not None
    if dp % known:
        name = "dp_replicate" if replicate is not None else "dp_shard"
        raise ValueError(f"{name}={known} does not divide dp={dp}; use a divisor of {dp}")
    r = replicate if replicate is not None else dp // known
    sh = shard if shard is not None else dp // known
    if r * sh != dp:
        raise ValueError(
            f"dp_replicate={given['dp_replicate']} x dp_shard={given['dp_shard']} = {r * sh} "
            f"does not match dp={dp}; give dp = dp_replicate * dp_shard (or leave dp out)"
        )
    return r, sh


def _check_dp_part(name: str, value: int | None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"mesh size {name}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"mesh size {name}={value} must be >= 1")


class Mesh:
    """Named dimensions over a world; it owns every group along any axis combination, and the
    counters (``stats``) that its groups' collectives record into (and into the world's).

    All ranks construct it together (it forms the process groups collectively).

    Args:
        dp, tp, pp: the size of each axis; one of them may be -1 (fill the world).
        dp_replicate, dp_shard: hierarchical sharding (HSDP): ZeRO shards over groups of
            ``dp_shard`` consecutive dp ranks (``group("dp_shard")``) and replicates across the
            ``dp_replicate`` groups (``group("dp_replicate")``); ``dp = dp_replicate *
            dp_shard``. Give both (dp may then be left out), or one to split a given dp.
            Default: flat, ``dp_shard = dp``.
        world: the world it spans (default: the current world, ``shardwise.init()``).
        world_size: the number of ranks the sizes must multiply to (default: the world's).
    """

    def __init__(
        self,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        dp_replicate: int | None = None,
        dp_shard: int | None = None,
        world: World | None = None,
        world_size: int | None = None,
    ) -> None:
        _check_dp_part("dp_replicate", dp_replicate)
        _check_dp_part("dp_shard", dp_shard)
        if dp_replicate is not None and dp_shard is not None:
            if dp not in (-1, dp_replicate * dp_shard):
                raise ValueError(
                    f"dp={dp} does not match dp_replicate={dp_replicate} x dp_shard={dp_shard} "
                    f"= {dp_replicate * dp_shard}; give dp = dp_replicate * dp_shard, or leave "
                    "dp out"
                )
            dp = dp_replicate * dp_shard
        if world is None and world_size is None:
            world = current()
        n = world.world_size if world is not None else world_size
        assert n is not None
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        for axis, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool):
                raise TypeError(f"mesh size {axis}={size!r} must be an int")
            if size == 0 or size < -1:
                raise ValueError(f"mesh size {axis}={size} must be >= 1 (or -1 to fill the world)")
        fill = [a for a, s in sizes.items() if s == -1]
        if len(fill) > 1:
            raise ValueError(f"only one mesh axis may be -1 (fill), got {fill}")
        known = 1
        for size in sizes.values():
            if size != -1:
                known *= size
        if fill:
            if n % known:
                raise ValueError(
                    f"world size {n} is not divisible by {known} "
                    f"({' x '.join(f'{a}={s}' for a, s in sizes.items() if s != -1)})"
                )
            sizes[fill[0]] = n // known
        product = sizes["pp"] * sizes["dp"] * sizes["tp"]
        if product != n:
            raise ValueError(
                f"mesh pp={sizes['pp']} x dp={sizes['dp']} x tp={sizes['tp']} = "
                f"{product} does not match the world size {n}"
            )
        self.sizes = sizes
        self.dp_replicate_size, self.dp_shard_size = _dp_split(sizes["dp"], dp_replicate, dp_shard)
        self.world_size = n
        self._groups: dict[tuple[str, ...], Group] = {}
        world = current() if world is None else world
        if world.world_size != n:
            raise ValueError(f"world_size={n} does not match the world's {world.world_size} ranks")
        self.world = world
        self.stats = CommStats(parent=world.stats)
        self.coords = self.coords_of(world.rank)
        # Form every axis combination's groups now: torch forms groups collectively, and doing it
        # here (all ranks, same order) keeps later lookups free of collective calls.
        for k in range(1, 4):
            for axes in itertools.combinations(AXES, k):
                for ranks in self._partition(axes):
                    g = world.new_group(ranks, name="+".join(axes), stats=self.stats)
                    if world.rank in ranks:
                        self._groups[axes] = g
        self._form_dp_parts()

    def _form_dp_parts(self) -> None:
        """The shard and replicate groups of the dp axis (flat: the dp group and a group of one,
        formed without torch)."""
        dp_group = self._groups[("dp",)]
        if self.dp_replicate_size == 1:
            self._groups[("dp_shard",)] = dp_group
            me = self.world.rank
            self._groups[("dp_replicate",)] = self.world.new_group(
                [me], name="dp_replicate", stats=self.stats
            )
            return
        r_size, s_size = self.dp_replicate_size, self.dp_shard_size
        for dp_ranks in self._partition(("dp",)):  # one per (pp, tp) coordinate
            parts = {
                "dp_shard": [dp_ranks[r * s_size : (r + 1) * s_size] for r in range(r_size)],
                "dp_replicate": [dp_ranks[sh::s_size] for sh in range(s_size)],
            }
            for name, groups in parts.items():
                for ranks in groups:
                    g = self.world.new_group(ranks, name=name, stats=self.stats)
                    if self.world.rank in ranks:
                        self._groups[(name,)] = g

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.sizes["dp"] + dp) * self.sizes["tp"] + tp

    def coords_of(self, rank: int) -> dict[str, int]:
        tp = rank % self.sizes["tp"]
        dp = (rank // self.sizes["tp"]) % self.sizes["dp"]
        pp = rank // (self.sizes["tp"] * self.sizes["dp"])
        return {"pp": pp, "dp": dp, "tp": tp}

    def _partition(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Groups of ranks that differ only along ``axes``, each in row-major order."""
        fixed = [a for a in AXES if a not in axes]
        out = []
        for fixed_vals in itertools.product(*(range(self.sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = []
            for vals in itertools.product(*(range(self.sizes[a]) for a in axes)):
                c = {**base, **dict(zip(axes, vals))}
                ranks.append(self.rank_of(c["pp"], c["dp"], c["tp"]))
            out.append(tuple(ranks))
        return out

    def group(self, *axes: str) -> Group:
        """The group of this rank's peers along ``axes`` (e.g. ``mesh.group("dp", "tp")``), or
        one part of the dp axis alone: ``group("dp_shard")`` / ``group("dp_replicate")``."""
        if len(axes) == 1 and axes[0] in DP_PARTS:
            return self._groups[(axes[0],)]
        if not axes:
            raise ValueError(f"name at least one mesh axis; allowed: {', '.join(AXES)}")
        bad = [a for a in axes if a not in AXES]
        if bad:
            raise ValueError(
                f"unknown mesh axis {bad}; allowed: {', '.join(AXES)} (or one of "
                f"{', '.join(DP_PARTS)} alone)"
            )
        key = tuple(a for a in AXES if a in axes)
        return self._groups[key]

    def rank(self, axis: str) -> int:
        if axis in DP_PARTS:
            return self._groups[(axis,)].rank
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; allowed: {', '.join(AXES)}")
        return self.coords[axis]

    def __repr__(self) -> str:
        split = ""
        if self.dp_replicate_size > 1:
            split = f" ({self.dp_replicate_size} x {self.dp_shard_size})"
        return (
            f"Mesh(pp={self.sizes['pp']}, dp={self.sizes['dp']}{split}, tp={self.sizes['tp']}, "
            f"coords={self.coords})"
        )

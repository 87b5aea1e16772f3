"""The process mesh: named axes pp x dp x tp over the world, built once.

Ranks are laid out row-major with pp outermost and tp innermost, so tensor-parallel peers are
neighbours (same node) and pipeline stages are farthest apart:
``rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank``.
"""

from __future__ import annotations

import itertools

from shardwise.comm.current_world import current
from shardwise.comm.groups import Group, World
from shardwise.comm.stats import CommStats

AXES = ("pp", "dp", "tp")


class Mesh:
    """Named dimensions over a world; it owns every group along any axis combination, and the
    counters (``stats``) that its groups' collectives record into (and into the world's).

    All ranks construct it together (it forms the process groups collectively).

    Args:
        dp, tp, pp: the size of each axis; one of them may be -1 (fill the world).
        world: the world it spans (default: the current world, ``shardwise.init()``).
        world_size: the number of ranks the sizes must multiply to (default: the world's).
    """

    def __init__(
        self,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        world: World | None = None,
        world_size: int | None = None,
    ) -> None:
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
        """The group of this rank's peers along ``axes`` (e.g. ``mesh.group("dp", "tp")``)."""
        if not axes:
            raise ValueError(f"name at least one mesh axis; allowed: {', '.join(AXES)}")
        bad = [a for a in axes if a not in AXES]
        if bad:
            raise ValueError(f"unknown mesh axis {bad}; allowed: {', '.join(AXES)}")
        key = tuple(a for a in AXES if a in axes)
        return self._groups[key]

    def rank(self, axis: str) -> int:
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; allowed: {', '.join(AXES)}")
        return self.coords[axis]

    def __repr__(self) -> str:
        return (
            f"Mesh(pp={self.sizes['pp']}, dp={self.sizes['dp']}, tp={self.sizes['tp']}, "
            f"coords={self.coords})"
        )

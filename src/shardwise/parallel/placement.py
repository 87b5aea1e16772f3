"""Where each parameter lives: one frozen value per parameter, per mesh axis.

Along each mesh axis a parameter is either

- ``Shard(dim)``: split along tensor dim ``dim``, axis rank i holding the i-th of ``size``
  equal pieces (``full_size``: the unpadded length when the pieces are zero-padded at the end,
  a vocabulary that does not divide by tp); ``Shard(dim, blocks=k)``: the dim is k equal
  consecutive blocks (a fused q|k|v projection), each split so, rank i holding the i-th piece
  of every block, in block order (its piece is k boxes of the whole tensor: ``real_pieces``);
- ``Replicate()``: the same values on every rank of the axis (``partial=True``: used on a
  slice of the sequence, so its gradient is a partial sum that a hook all-reduces over the
  axis in backward, sequence parallelism);
- ``StageOwned(holders)``: the axis splits the model (pipeline stages): each rank holds its
  own parameters; ``holders`` lists the axis ranks holding copies of a tied parameter, the
  first of which counts and saves it.

A ``Placement`` records that for one parameter (its name, its whole unpadded shape and, for
every mesh axis larger than one, the style with the axis's size and this rank's coordinate).
It is a value: the plan returned by ``shardwise.parallelize`` holds one per parameter name and
``shardwise.initialize`` takes it; nothing is registered globally or hung on parameters. The
engine, the gradient-norm reduction, the checkpoint boxes and the saving group derive from it.
ZeRO's own sharding of flat buffers over the data-parallel group is the engine's storage, not a
placement: along dp a parameter is ``Replicate()``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group
from shardwise.mesh import AXIS_ORDER, Axis, Mesh, as_axis


@dataclass(frozen=True)
class Shard:
    """Split along tensor dim ``dim``; ``full_size``: the unpadded length when padded;
    ``blocks``: the dim holds that many equal blocks, each split alike (never padded)."""

    dim: int
    full_size: int | None = None
    blocks: int = 1


@dataclass(frozen=True)
class Replicate:
    """The same values on every rank of the axis; ``partial``: its gradient is a partial sum
    over the axis (all-reduced by a hook in backward)."""

    partial: bool = False


@dataclass(frozen=True)
class StageOwned:
    """Held by this pipeline stage alone, or (``holders``) copied on those axis ranks."""

    holders: tuple[int, ...] = ()


Style = Shard | Replicate | StageOwned
# the data-parallel axes ZeRO shards flat buffers over (cp ranks train on other tokens of the
# same sequences: for ZeRO they are data-parallel ranks); a parameter joins the group of those
# it is replicated along (see ``Placement.zero_axes``)
ZERO_AXES: tuple[Axis, ...] = (Axis.DP_SHARD, Axis.CP)
GroupOf = Callable[[Axis], Group]
Piece = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""``(local offsets, whole offsets, shape)``: one box of a rank's piece, in its local tensor and
in the whole one."""


@dataclass(frozen=True)
class AxisPlace:
    """One axis of a placement: its style, the axis's size and this rank's coordinate."""

    axis: Axis
    style: Style
    size: int
    rank: int


@dataclass(frozen=True)
class Placement:
    """One parameter's layout over the mesh (see the module docstring).

    ``axes`` lists, in mesh order, every axis whose style is not plain ``Replicate()`` or whose
    copies matter (replicated axes larger than one); an axis not listed is replicated.
    """

    name: str
    full_shape: tuple[int, ...]
    axes: tuple[AxisPlace, ...] = field(default=())

    @classmethod
    def on(
        cls,
        mesh: Mesh,
        name: str,
        full_shape: Sequence[int],
        styles: Mapping[str | Axis, Style],
    ) -> Placement:
        """The placement of ``name`` (whole shape ``full_shape``) on ``mesh``: ``styles`` per
        axis; every other axis larger than one is ``Replicate()``."""
        given = {as_axis(a): s for a, s in styles.items()}
        places = []
        for axis in AXIS_ORDER:
            size = mesh.axis_sizes[axis]
            style = given.pop(axis, Replicate())
            if size > 1:
                places.append(AxisPlace(axis, style, size, mesh.rank(axis)))
        if given:
            raise ValueError(f"{name}: style for {sorted(map(str, given))}, not a mesh's own axis")
        out = cls(name, tuple(int(n) for n in full_shape), tuple(places))
        out.check()
        return out

    def check(self) -> None:
        """Raise ValueError naming the parameter for a shard dim out of range, or blocks that
        are not all equal pieces (mixed along one dim, padded, or not dividing the dim)."""
        blocks: dict[int, int] = {}
        for a in self.axes:
            if not isinstance(a.style, Shard):
                continue
            d, k = a.style.dim, a.style.blocks
            if not 0 <= d < len(self.full_shape):
                raise ValueError(
                    f"{self.name}: Shard(dim={d}) over {a.axis} is out of range for "
                    f"shape {self.full_shape}"
                )
            if k < 1 or blocks.setdefault(d, k) != k or (k > 1 and a.style.full_size):
                raise ValueError(
                    f"{self.name}: Shard(dim={d}, blocks={k}) over {a.axis}: blocks must be "
                    "at least 1, the same on every axis splitting the dim, and never padded"
                )
        for d, (n, _, k) in self._dim_splits().items():
            if k > 1 and self.full_shape[d] % (k * n):
                raise ValueError(
                    f"{self.name}: dim {d} of {self.full_shape} does not split into {k} "
                    f"blocks of {n} equal pieces"
                )

    def style(self, axis: str | Axis) -> Style:
        for a in self.axes:
            if a.axis == axis:
                return a.style
        return Replicate()

    @property
    def shards(self) -> tuple[AxisPlace, ...]:
        """The axes that split the tensor, outermost first."""
        return tuple(a for a in self.axes if isinstance(a.style, Shard))

    @property
    def copies(self) -> tuple[Axis, ...]:
        """Axes whose ranks hold identical copies of this rank's piece (larger than one; a
        tied pipeline copy is ``first_holder``'s business)."""
        return tuple(a.axis for a in self.axes if isinstance(a.style, Replicate))

    @property
    def first_holder(self) -> bool:
        """False for a tied copy on a pipeline rank that is not its first holder."""
        for a in self.axes:
            if isinstance(a.style, StageOwned) and a.style.holders:
                return a.rank == a.style.holders[0]
        return True

    @property
    def partial_axes(self) -> tuple[Axis, ...]:
        return tuple(a.axis for a in self.axes if a.style == Replicate(partial=True))

    def _dim_splits(self) -> dict[int, tuple[int, int, int]]:
        """Per split dim: (pieces, this rank's piece index, blocks), nested axes flattened
        (outer first)."""
        out: dict[int, tuple[int, int, int]] = {}
        for a in self.shards:
            assert isinstance(a.style, Shard)
            n, i, _ = out.get(a.style.dim, (1, 0, 1))
            out[a.style.dim] = (n * a.size, i * a.size + a.rank, a.style.blocks)
        return out

    @property
    def blocked(self) -> bool:
        """Whether a split dim holds several blocks (this rank's piece is several boxes)."""
        return any(k > 1 for _, _, k in self._dim_splits().values())

    def local_shape(self) -> tuple[int, ...]:
        """This rank's tensor: ``ceil(n / pieces)`` along each split dim (padding included)."""
        shape = list(self.full_shape)
        for d, (n, _, _) in self._dim_splits().items():
            shape[d] = math.ceil(shape[d] / n)
        return tuple(shape)

    def real_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, shape)`` of this rank's piece in the whole tensor, padding cut. Raises
        ValueError naming the parameter when the piece is several boxes (``real_pieces``)."""
        if self.blocked:
            raise ValueError(
                f"{self.name}: its piece is several boxes of the whole tensor (Shard blocks); "
                "read it with real_pieces()"
            )
        local = self.local_shape()
        offsets, shape = [0] * len(local), list(local)
        for d, (_, i, _) in self._dim_splits().items():
            start = min(i * local[d], self.full_shape[d])
            offsets[d], shape[d] = start, min(local[d], self.full_shape[d] - start)
        return tuple(offsets), tuple(shape)

    def real_pieces(self) -> list[Piece]:
        """The boxes of this rank's piece, padding cut, in local order: ``(offsets in the
        local tensor, offsets in the whole one, shape)``; one box unless a dim holds blocks
        (then one per block), none when the piece is all padding."""
        local = self.local_shape()
        runs: list[list[tuple[int, int, int]]] = []  # per dim: (local, whole, length)
        splits = self._dim_splits()
        for d, size in enumerate(local):
            _, i, k = splits.get(d, (1, 0, 1))
            if k == 1:
                start = min(i * size, self.full_shape[d])
                runs.append([(0, start, min(size, self.full_shape[d] - start))])
            else:
                block, piece = self.full_shape[d] // k, size // k
                runs.append([(b * piece, b * block + i * piece, piece) for b in range(k)])
        out = []
        for combo in itertools.product(*runs):
            lo, whole, shape = (tuple(r[j] for r in combo) for j in range(3))
            if all(shape):
                out.append((lo, whole, shape))
        return out

    @property
    def padded(self) -> bool:
        """Whether a split dim does not divide by its pieces (the last pieces end in zeros)."""
        return any(self.full_shape[d] % n for d, (n, _, _) in self._dim_splits().items())

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole tensor ``full`` (zero where the piece is padding).
        Raises ValueError naming the parameter when ``full`` does not have the whole shape."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"{self.name}: expected the whole tensor of shape {self.full_shape}, got "
                f"{tuple(full.shape)}"
            )
        out = full.new_zeros(self.local_shape())
        for lo, whole, shape in self.real_pieces():
            out[_slices(lo, shape)] = full[_slices(whole, shape)]
        return out

    @property
    def zero_axes(self) -> tuple[Axis, ...]:
        """The data-parallel axes (``ZERO_AXES``) this parameter is replicated along: ZeRO
        shards its flat buffer over their ranks."""
        return tuple(a for a in ZERO_AXES if isinstance(self.style(a), Replicate))

    def gather_full(self, local: torch.Tensor, group_of: GroupOf) -> torch.Tensor:
        """The whole parameter from every rank's ``local`` piece, padding cut (call on every
        rank of every split axis). Blocks come back in order, each whole ([q|k|v]).
        Communicates: one all_gather per split axis, innermost first."""
        out = local.detach()
        for a in reversed(self.shards):
            assert isinstance(a.style, Shard)
            front = out.movedim(a.style.dim, 0).contiguous()
            gathered = ops.all_gather(front, group=group_of(a.axis))
            assert isinstance(gathered, torch.Tensor)
            k = a.style.blocks
            if k > 1:  # rank-major [r0: b0 b1 ..][r1: ..] -> block-major [b0: r0 r1 ..] ..
                rest = gathered.shape[1:]
                gathered = gathered.view(a.size, k, -1, *rest).transpose(0, 1)
                gathered = gathered.reshape(-1, *rest)
            out = gathered.movedim(0, a.style.dim)
        for d, n in enumerate(self.full_shape):
            out = out.narrow(d, 0, n)
        return out.contiguous()


def _slices(offsets: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


def replicated(name: str, shape: Sequence[int]) -> Placement:
    """A parameter every rank holds whole (no mesh, or replicated along every axis)."""
    return Placement(name, tuple(int(n) for n in shape))


class NormReduction:
    """How this rank's part of the global gradient norm is summed over a mesh.

    Every parameter must be counted exactly once. ZeRO's dp slices are summed by the caller
    (``zero.step``). On top of that the squares are all-reduced over every other axis that
    splits some parameter (``Shard`` or ``StageOwned``), in mesh order: a parameter split over
    an axis is summed over it; a parameter replicated along it holds the same values on each of
    its ranks, so only the axis's first rank counts it (no division: the sum stays exact and
    every rank ends with the same bits); a tied copy is counted by its first holder only.
    """

    def __init__(
        self,
        params: Iterable[tuple[torch.Tensor, Placement]],
        group_of: GroupOf,
        data_parallel: Sequence[Axis] = (Axis.DP_REPLICATE, Axis.DP_SHARD),
    ) -> None:
        pairs = list(params)
        split: list[Axis] = []
        for _, where in pairs:
            for a in where.axes:
                if a.axis in data_parallel or a.axis in split:
                    continue
                if isinstance(a.style, (Shard, StageOwned)):
                    split.append(a.axis)
        self.axes = tuple(a for a in AXIS_ORDER if a in split)
        self.groups = tuple(group_of(a) for a in self.axes)
        self._skipped: set[int] = set()
        for p, where in pairs:
            for a in where.axes:
                if a.axis not in self.axes:
                    continue
                st = a.style
                # replicated along an axis ZeRO shards it over: each rank holds its own
                # disjoint slice, so every rank counts it (``reduce`` leaves that axis to ZeRO)
                zero_sharded = a.axis in where.zero_axes
                if isinstance(st, Replicate) and a.rank != 0 and not zero_sharded:
                    self._skipped.add(id(p))
                if isinstance(st, StageOwned) and st.holders and st.holders[0] != a.rank:
                    self._skipped.add(id(p))

    def counts(self, param: torch.Tensor) -> bool:
        """Whether this rank adds ``param``'s local squares before the reductions."""
        return id(param) not in self._skipped

    def reduce(self, sumsq: torch.Tensor, within: Group | None = None) -> None:
        """Sum ``sumsq`` (one fp32 value) over every splitting axis in turn, except the axes
        inside ``within`` (the ZeRO group whose slices ``sumsq`` sums: the caller sums over
        it). Communicates: one all_reduce of 4 bytes per axis."""
        inside = set(within.ranks) if within is not None else set()
        for g in self.groups:
            if not set(g.ranks) <= inside:
                ops.all_reduce(sumsq, op="sum", group=g)

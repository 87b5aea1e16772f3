"""Where each parameter lives: which groups split it along a tensor dim, which hold copies.

A parallel layer that shards a parameter (tensor parallelism splits a Linear's weight over the
mesh's tp axis) says so once, from outside the model::

    shard = nn.Parameter(full.chunk(tp_size, dim=0)[tp_rank].clone())
    shardwise.parallel.placement.mark_sharded(shard, mesh.group("tp"), dim=0)

The record lives in a table of our own keyed by the parameter object (weakly: it goes away with
the parameter), never as an attribute on the ``nn.Parameter``. The engine reads it at
``initialize``: ZeRO flattens and shards each rank's local parameters over the dp group on top
of this, and the global gradient norm sums each parameter once over every axis
(:class:`NormReduction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.comm import ops
from shardwise.comm.groups import Group


@dataclass(frozen=True)
class Shard:
    """A parameter split along tensor dim ``dim`` over ``group``: group rank i holds the i-th of
    ``group.size`` equal pieces. ``full_size``: the whole length along ``dim`` when the pieces
    are padded at the end (a vocabulary that does not divide by the group size); None: the
    pieces' total."""

    group: Group
    dim: int
    full_size: int | None = None


@dataclass(frozen=True)
class Placement:
    """A parameter's layout over the process groups that hold it.

    ``shards``: tensor-dim splits made by parallel layers (e.g. tp), in the order they were
    marked. ``zero``: the group ZeRO flattens and shards it over (the engine's dp group; None
    outside an engine). ``replicated``: mesh groups whose ranks hold identical copies of this
    rank's local tensor (e.g. tp for a norm weight).
    """

    shards: tuple[Shard, ...] = ()
    zero: Group | None = None
    replicated: tuple[Group, ...] = ()

    def is_sharded_over(self, group: Group) -> bool:
        return any(s.group is group for s in self.shards)

    def full_shape(self, local: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the whole parameter, from this rank's local shape."""
        shape = list(local)
        for s in self.shards:
            shape[s.dim] *= s.group.size
        for s in self.shards:  # padding is at the end of the whole dim
            if s.full_size is not None:
                shape[s.dim] = s.full_size
        return tuple(shape)

    def offsets(self, local: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """Where this rank's piece starts in the whole parameter, per tensor dim (splits over
        several groups along one dim nest in marking order)."""
        start, length = [0] * len(local), list(local)
        for s in self.shards:
            length[s.dim] *= s.group.size
        for s in self.shards:
            length[s.dim] //= s.group.size
            start[s.dim] += s.group.rank * length[s.dim]
        full = self.full_shape(local)
        return tuple(min(a, n) for a, n in zip(start, full))

    def real_box(
        self, local: torch.Size | tuple[int, ...]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, shape)`` of this rank's piece inside the whole parameter, padding cut:
        the shape is the local one where the piece ends past the unpadded length."""
        offsets, full = self.offsets(local), self.full_shape(local)
        shape = tuple(min(n, f - o) for n, o, f in zip(local, offsets, full))
        return offsets, shape


def gather_full(local: torch.Tensor, where: Placement) -> torch.Tensor:
    """The whole parameter from every rank's ``local`` piece, padding cut (call on every rank
    of every group in ``where.shards``, in the same order on each). Communicates: one
    all_gather per shard group, innermost split first."""
    out = local.detach()
    for s in reversed(where.shards):
        front = out.movedim(s.dim, 0).contiguous()
        gathered = ops.all_gather(front, group=s.group)
        assert isinstance(gathered, torch.Tensor)
        out = gathered.movedim(0, s.dim)
    for d, n in enumerate(where.full_shape(local.shape)):
        out = out.narrow(d, 0, n)
    return out.contiguous()


def shard_of_full(
    full: torch.Tensor, where: Placement, local: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """This rank's piece (of shape ``local``) of the whole parameter ``full``, zero where the
    piece is padding. Raises ValueError when ``full`` does not have the whole shape."""
    want = where.full_shape(local)
    if tuple(full.shape) != want:
        raise ValueError(f"expected the whole tensor of shape {want}, got {tuple(full.shape)}")
    offsets, shape = where.real_box(local)
    out = full.new_zeros(tuple(local))
    index = tuple(slice(0, n) for n in shape)
    out[index] = full[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
    return out


_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_sharded(
    param: torch.Tensor, group: Group, dim: int, full_size: int | None = None
) -> Placement:
    """Record that ``param`` is this rank's piece of a tensor split along ``dim`` over
    ``group`` (call it on every rank, right after creating the local piece and before
    ``shardwise.initialize``). ``full_size``: the unpadded length of ``dim`` when the pieces
    are zero-padded at the end (their gradients there must be zero). Marking the same group
    again replaces its entry; a parameter may be split over several groups. Returns the
    placement so far.

    Raises:
        TypeError: ``param`` is not a tensor or ``group`` not a ``shardwise.Group``.
        ValueError: ``dim`` is out of range, or ``group`` has only this rank.
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"mark_sharded needs a parameter tensor, got {type(param).__name__}")
    if not isinstance(group, Group):
        raise TypeError(f"mark_sharded needs a shardwise.Group, got {type(group).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -param.dim() <= dim < param.dim():
        raise ValueError(
            f"dim={dim!r} is out of range for a parameter of shape {tuple(param.shape)}"
        )
    if not group.is_member:
        raise ValueError(f"this rank is not a member of {group}; mark only its own pieces")
    dim %= param.dim()
    most = param.shape[dim] * group.size
    if full_size is not None and not (isinstance(full_size, int) and 0 < full_size <= most):
        raise ValueError(f"full_size={full_size!r} must be an int in [1, {most}]")
    kept = tuple(s for s in _SHARDS.get(param, ()) if s.group is not group)
    shards = (*kept, Shard(group, dim, full_size))
    _SHARDS[param] = shards
    return Placement(shards)


def unmark(param: torch.Tensor) -> None:
    """Forget every split recorded for ``param`` (it is whole again)."""
    _SHARDS.pop(param, None)


def placement_of(param: torch.Tensor) -> Placement:
    """The splits recorded for ``param`` (no ZeRO group: the engine adds that)."""
    return Placement(_SHARDS.get(param, ()))


class NormReduction:
    """How this rank's part of the global gradient norm is summed over a mesh.

    Every parameter must be counted exactly once. ZeRO's dp slices are summed by the caller
    (``zero.step``). On top of that the squares are all-reduced over every other group that
    splits some parameter (in first-seen order, the same on every rank): a parameter split over
    a group is summed over it; a parameter not split over it holds the same values on each of
    its ranks, so only the group's first rank counts it (no division: the sum stays exact and
    every rank ends with the same bits). ``extra``: groups that split every parameter (the pp
    axis: each stage holds its own layers). ``counted_elsewhere``: parameters whose copy
    another rank counts (a tied weight on every pipeline stage but its first holder).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        dp: Group,
        extra: tuple[Group, ...] = (),
        counted_elsewhere: Sequence[torch.Tensor] = (),
    ) -> None:
        groups: list[Group] = list(extra)
        for p in params:
            for s in placement_of(p).shards:
                if all(s.group is not g for g in groups):
                    groups.append(s.group)
        for g in groups:
            _check_orthogonal(g, dp)
        self.groups = tuple(groups)
        # ids of parameters another rank counts (of some group, or a copy another rank holds)
        self._skipped: set[int] = {id(p) for p in counted_elsewhere}
        for p in params:
            where = placement_of(p)
            for g in groups:
                split = where.is_sharded_over(g) or any(g is e for e in extra)
                if not split and g.rank != 0:
                    self._skipped.add(id(p))

    def counts(self, param: torch.Tensor) -> bool:
        """Whether this rank adds ``param``'s local squares before the reductions."""
        return id(param) not in self._skipped

    def reduce(self, sumsq: torch.Tensor) -> None:
        """Sum ``sumsq`` (one fp32 value) over every group in turn. Communicates: one
        all_reduce of 4 bytes per group."""
        for g in self.groups:
            ops.all_reduce(sumsq, op="sum", group=g)


def _check_orthogonal(group: Group, dp: Group) -> None:
    me = dp.ranks[dp.rank]
    if set(group.ranks) & set(dp.ranks) != {me}:
        raise ValueError(
            f"a parameter is split over {group}, which shares ranks with the data-parallel "
            f"group {dp}; a split group must be another mesh axis (e.g. mesh.group('tp'))"
        )

"""Where a rank's local parameter sits in the saved (global) tensor.

A parameter split by a parallel layer (tensor parallelism, ``placement.mark_sharded``) is saved
under its whole, unpadded shape: each rank's piece is a box at its offsets, padding rows cut,
and a piece that other ranks of a mesh group hold identical copies of (a tp-replicated norm
weight) is written by one of them only. ZeRO's flat ranges are ranges of the *local* tensor;
:func:`range_entries` and :func:`read_range` map them onto boxes of the global one, so a
checkpoint written at one (dp, tp) layout reads back at any other. Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.checkpoint.entries import (
    Box,
    ShardEntry,
    flat_range_boxes,
    intersect,
    local_slices,
)
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.comm.groups import Group
from shardwise.parallel.placement import Placement


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's local tensor inside its saved global tensor."""

    local_shape: tuple[int, ...]
    """Shape of this rank's tensor (padding included)."""
    offsets: tuple[int, ...]
    """Where the local tensor starts in the global one, per dim."""
    real_shape: tuple[int, ...]
    """The local tensor's extent that is not padding (a box from its origin)."""
    global_shape: tuple[int, ...]
    """Shape of the whole, unpadded parameter: what the checkpoint stores."""
    writes: bool = True
    """This rank writes its piece (False: a peer holding an identical copy writes it)."""

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> ParamLayout:
        """A parameter that is not split: local and global are the same tensor."""
        return cls(tuple(shape), (0,) * len(shape), tuple(shape), tuple(shape))

    @classmethod
    def of(
        cls, local: tuple[int, ...], where: Placement, copies: tuple[Group, ...] = ()
    ) -> ParamLayout:
        """The layout of a local tensor of shape ``local`` placed as ``where``; ``copies``:
        groups whose ranks hold the same piece (only their first rank writes it)."""
        offsets, real = where.real_box(local)
        writes = all(g.rank == 0 for g in copies)
        return cls(tuple(local), offsets, real, where.full_shape(local), writes)

    def _real(self) -> Box:
        return (0,) * len(self.local_shape), self.real_shape

    def _to_global(self, box: Box) -> tuple[int, ...]:
        return tuple(o + g for o, g in zip(box[0], self.offsets))


def param_layouts(
    module: nn.Module, placement: Callable[[torch.Tensor], Placement], dp: Group
) -> dict[int, ParamLayout]:
    """Each split or mesh-replicated parameter of ``module`` by id: pieces of split parameters
    at their offsets (padding cut); a piece that the ranks of a mesh group other than ``dp``
    hold identical copies of is written by the first of them only. ``placement``: the engine's
    (its ``replicated`` groups name the copies)."""
    out: dict[int, ParamLayout] = {}
    for p in module.parameters():
        where = placement(p)
        copies = tuple(g for g in where.replicated if g is not dp)
        if where.shards or copies:
            out[id(p)] = ParamLayout.of(tuple(p.shape), where, copies)
    return out


def layout_of(layouts: Mapping[int, ParamLayout], param: torch.Tensor) -> ParamLayout:
    """``param``'s layout, or the whole one when it is not in ``layouts``."""
    found = layouts.get(id(param))
    return found if found is not None else ParamLayout.whole(tuple(param.shape))


def range_entries(
    name: str, layout: ParamLayout, start: int, flat: torch.Tensor
) -> list[ShardEntry]:
    """Entries for local flat elements ``[start, start + flat.numel())`` (``flat`` 1-D): the
    boxes of that range, padding cut, at their global offsets (views, no copy). None when a
    peer writes this piece."""
    if not layout.writes:
        return []
    out = []
    stop = start + flat.numel()
    for box, lo in flat_range_boxes(layout.local_shape, start, stop):
        part = intersect(box, layout._real())
        if part is None:
            continue
        values = flat[lo - start : lo - start + math.prod(box[1])].view(box[1])
        values = values[local_slices(part, box)]
        out.append(ShardEntry(name, layout.global_shape, layout._to_global(part), values))
    return out


def read_range(
    reader: CheckpointReader, name: str, layout: ParamLayout, start: int, stop: int
) -> torch.Tensor:
    """Local flat elements ``[start, stop)`` of tensor ``name`` as a 1-D tensor in its stored
    dtype, read box by box from the global tensor; padding elements are zero."""
    out = torch.zeros(stop - start, dtype=reader.dtype(name))
    for box, lo in flat_range_boxes(layout.local_shape, start, stop):
        part = intersect(box, layout._real())
        if part is None:
            continue
        values = reader.read_box(name, layout._to_global(part), part[1])
        if part != box:
            padded = torch.zeros(box[1], dtype=values.dtype)
            padded[local_slices(part, box)] = values
            values = padded
        out[lo - start : lo - start + values.numel()] = values.reshape(-1)
    return out

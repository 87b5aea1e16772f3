"""Where a rank's local parameter sits in the saved (global) tensor.

A parameter split by a parallel layer (its ``Placement``, e.g. tensor parallelism) is saved
under its whole, unpadded shape: each rank's piece is a box at its offsets, padding rows cut,
and a piece that other ranks of a mesh group hold identical copies of (a tp-replicated norm
weight) is written by one of them only. ZeRO's flat ranges are ranges of the *local* tensor;
:func:`range_entries` and :func:`read_range` map them onto boxes of the global one, so a
checkpoint written at one (dp, tp) layout reads back at any other. Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardwise.checkpoint.entries import (
    Box,
    ShardEntry,
    flat_range_boxes,
    intersect,
    local_slices,
)
from shardwise.checkpoint.reader import CheckpointReader


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

    def _real(self) -> Box:
        return (0,) * len(self.local_shape), self.real_shape

    def _to_global(self, box: Box) -> tuple[int, ...]:
        return tuple(o + g for o, g in zip(box[0], self.offsets))


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

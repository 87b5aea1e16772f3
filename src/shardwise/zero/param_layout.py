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

Piece = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""``(offsets in the local tensor, offsets in the global one, shape)``: one box of a piece."""


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's local tensor inside its saved global tensor."""

    local_shape: tuple[int, ...]
    """Shape of this rank's tensor (padding included)."""
    pieces: tuple[Piece, ...]
    """The local tensor's boxes that are not padding: ``(offsets in the local tensor, offsets
    in the global one, shape)``; one box, or one per block of a blocked split (q|k|v)."""
    global_shape: tuple[int, ...]
    """Shape of the whole, unpadded parameter: what the checkpoint stores."""
    writes: bool = True
    """This rank writes its piece (False: a peer holding an identical copy writes it)."""

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> ParamLayout:
        """A parameter that is not split: local and global are the same tensor."""
        zeros = (0,) * len(shape)
        return cls(tuple(shape), ((zeros, zeros, tuple(shape)),), tuple(shape))

    def parts(self, box: Box) -> list[tuple[Box, tuple[int, ...]]]:
        """The parts of local ``box`` that are not padding, each with its global offsets."""
        out = []
        for at, origin, shape in self.pieces:
            part = intersect(box, (at, shape))
            if part is not None:
                out.append((part, tuple(o + p - a for o, p, a in zip(origin, part[0], at))))
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
        values = flat[lo - start : lo - start + math.prod(box[1])].view(box[1])
        for part, origin in layout.parts(box):
            part_values = values[local_slices(part, box)]
            out.append(ShardEntry(name, layout.global_shape, origin, part_values))
    return out


def read_range(
    reader: CheckpointReader, name: str, layout: ParamLayout, start: int, stop: int
) -> torch.Tensor:
    """Local flat elements ``[start, stop)`` of tensor ``name`` as a 1-D tensor in its stored
    dtype, read box by box from the global tensor; padding elements are zero."""
    out = torch.zeros(stop - start, dtype=reader.dtype(name))
    for box, lo in flat_range_boxes(layout.local_shape, start, stop):
        values = out[lo - start : lo - start + math.prod(box[1])].view(box[1])
        for part, origin in layout.parts(box):
            values[local_slices(part, box)] = reader.read_box(name, origin, part[1])
    return out

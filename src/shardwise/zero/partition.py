"""Shard math: where each parameter lies in a padded flat buffer and what each rank owns.

A unit's parameters are laid end to end in one flat buffer, padded with zeros to a multiple of
the group size N; rank r owns elements ``[r * S, (r + 1) * S)`` with ``S = padded / N``. The
padding is never read back into a parameter, so it cannot leak into results.
"""

from __future__ import annotations

from dataclasses import dataclass


def padded_numel(numel: int, parts: int) -> int:
    """``numel`` rounded up to a multiple of ``parts`` (at least ``parts``)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return max(parts, -(-numel // parts) * parts)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter inside one rank's shard.

    ``param_start``/``param_stop`` index the parameter flattened row-major; ``shard_start`` is
    where the piece begins inside the shard.
    """

    slot: ParamSlot
    param_start: int
    param_stop: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start


def layout(names: list[str], shapes: list[tuple[int, ...]]) -> tuple[list[ParamSlot], int]:
    """Slots for parameters laid end to end; returns them and the unpadded total."""
    slots, offset = [], 0
    for name, shape in zip(names, shapes):
        n = 1
        for d in shape:
            n *= d
        slots.append(ParamSlot(name, tuple(shape), offset, n))
        offset += n
    return slots, offset


def shard_range(padded: int, parts: int, index: int) -> tuple[int, int]:
    """Flat range ``[start, stop)`` owned by shard ``index`` of ``parts``."""
    if padded % parts:
        raise ValueError(f"padded size {padded} is not a multiple of {parts}")
    size = padded // parts
    return index * size, (index + 1) * size


def pieces_in(slots: list[ParamSlot], start: int, stop: int) -> list[ShardPiece]:
    """The non-empty parameter pieces that fall inside flat range ``[start, stop)``."""
    out = []
    for s in slots:
        lo, hi = max(s.offset, start), min(s.end, stop)
        if lo < hi:
            out.append(ShardPiece(s, lo - s.offset, hi - s.offset, lo - start))
    return out

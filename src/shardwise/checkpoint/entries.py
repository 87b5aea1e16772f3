"""What a save is made of: boxes of logical tensors, each at its n-dimensional offsets.

A logical tensor (``model/blocks.0.attn.qkv.weight``) has a global shape. A rank saves boxes of
it: a box is the slice ``[offsets[d], offsets[d] + shape[d])`` on every dim ``d``. Any layout
maps onto boxes: a row- or column-parallel shard is one box; a flat range of the row-major
tensor (a ZeRO shard) is at most ``2 * ndim - 1`` boxes (:func:`flat_range_boxes`). Over all
ranks of a save, the boxes of a tensor must cover it exactly once; a reader assembles any box
from whichever stored boxes intersect it, so every layout reshards through one path.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardwise.checkpoint.files import SAFETENSORS_DTYPES

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, shape)`` of a box, one entry per dim of the global tensor."""

MAX_DESCRIBED_RUNS = 1_000_000
"""A coverage problem is described element-exactly when the boxes have at most this many rows."""


@dataclass
class ShardEntry:
    """One box of one logical tensor, held by this rank."""

    name: str
    """Logical tensor name, e.g. ``model/blocks.0.attn.qkv.weight`` or ``optim/<param>/exp_avg``."""
    global_shape: tuple[int, ...]
    """Shape of the whole (unsharded) tensor."""
    offsets: tuple[int, ...]
    """Where the box starts on each dim of the global tensor."""
    tensor: torch.Tensor
    """The box's values: one dim per dim of ``global_shape``; CUDA tensors are copied to host."""

    @property
    def box(self) -> Box:
        return self.offsets, tuple(self.tensor.shape)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Box, int]]:
    """The boxes that make up flat elements ``[start, stop)`` of a row-major ``shape``.

    Returns ``[((offsets, box_shape), flat_start), ...]`` in flat order; each box's elements
    are the contiguous flat range ``[flat_start, flat_start + prod(box_shape))``.
    """
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) must lie within [0, {numel}) of {shape}")
    return list(_boxes(tuple(shape), start, stop, (), 0))


def _boxes(
    shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], base: int
) -> Iterator[tuple[Box, int]]:
    if start >= stop:
        return
    if not shape:  # a scalar: its one element
        yield (prefix, ()), base
        return
    if len(shape) == 1:
        yield ((*prefix, start), (stop - start,)), base + start
        return
    row = math.prod(shape[1:])
    first, last = -(-start // row), stop // row  # rows wholly inside [start, stop)
    if first > last:  # inside one row
        r = start // row
        yield from _sub_row(shape, r, start - r * row, stop - r * row, prefix, base + r * row)
        return
    if start % row:
        r = start // row
        yield from _sub_row(shape, r, start % row, row, prefix, base + r * row)
    if last > first:
        box = (prefix + (first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]))
        yield box, base + first * row
    if stop % row:
        yield from _sub_row(shape, last, 0, stop % row, prefix, base + last * row)


def _sub_row(
    shape: tuple[int, ...], r: int, lo: int, hi: int, prefix: tuple[int, ...], base: int
) -> Iterator[tuple[Box, int]]:
    for (offsets, box_shape), flat in _boxes(shape[1:], lo, hi, (), base):
        yield ((*prefix, r, *offsets), (1, *box_shape)), flat


def intersect(a: Box, b: Box) -> Box | None:
    """The box where ``a`` and ``b`` overlap, or None when they share no element."""
    offsets, shape = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor holding ``within`` (``box`` must lie inside it)."""
    return tuple(slice(o - w, o - w + s) for o, s, w in zip(box[0], box[1], within[0]))


def _runs(box: Box, shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """The flat ranges (row-major in ``shape``) that a box covers, one per innermost row."""
    offsets, size = box
    if not shape:
        yield 0, 1
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    outer = [range(o, o + s) for o, s in zip(offsets[:-1], size[:-1])]
    for idx in _product(outer):
        flat = sum(i * st for i, st in zip(idx, strides)) + offsets[-1]
        yield flat, flat + size[-1]


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


def _flat_problem(name: str, numel: int, spans: list[tuple[int, int, str]]) -> str | None:
    covered, last_owner = 0, ""
    for start, stop, owner in sorted(spans):
        if start < covered:
            return (
                f"tensor {name!r}: {owner} covers element {start} but {last_owner} "
                f"already covers up to {covered} (overlap)"
            )
        if start > covered:
            return f"tensor {name!r}: elements [{covered}, {start}) are held by no rank (gap)"
        covered, last_owner = stop, owner
    if covered != numel:
        return (
            f"tensor {name!r}: elements [{covered}, {numel}) are held by no rank (gap); "
            f"the boxes of all ranks must cover the tensor ({numel} elements) exactly once"
        )
    return None


def _overlapping(boxes: list[tuple[Box, str]]) -> tuple[str, str] | None:
    """Two owners whose boxes share an element (a sweep along dim 0), or None."""
    active: list[tuple[Box, str]] = []
    for box, owner in sorted(boxes, key=lambda b: b[0][0]):
        start0 = box[0][0] if box[0] else 0
        active = [a for a in active if not a[0][0] or a[0][0][0] + a[0][1][0] > start0]
        for other, other_owner in active:
            if intersect(box, other) is not None:
                return other_owner, owner
        active.append((box, owner))
    return None


def coverage_problem(name: str, shape: tuple[int, ...], boxes: list[tuple[Box, str]]) -> str | None:
    """What is wrong with ``boxes`` (box, owner) covering ``shape`` exactly once, or None."""
    boxes = [(b, o) for b, o in boxes if math.prod(b[1]) > 0]
    for (offsets, size), owner in boxes:
        if len(offsets) != len(shape) or any(
            o < 0 or o + s > d for o, s, d in zip(offsets, size, shape)
        ):
            return f"tensor {name!r}: {owner} box {offsets}+{size} lies outside {shape}"
    numel = math.prod(shape)
    volume = sum(math.prod(b[1]) for b, _ in boxes)
    clash = _overlapping(boxes)
    if volume == numel and clash is None:
        return None
    rows = sum(math.prod(b[1][:-1]) for b, _ in boxes)
    if rows <= MAX_DESCRIBED_RUNS:
        spans = [(lo, hi, owner) for b, owner in boxes for lo, hi in _runs(b, shape)]
        found = _flat_problem(name, numel, spans)
        if found is not None:
            return found
    if clash is not None:
        return f"tensor {name!r}: {clash[0]} and {clash[1]} hold the same elements (overlap)"
    return f"tensor {name!r}: {numel - volume} of {numel} elements are held by no rank (gap)"


def _check_entry(i: int, e: object) -> None:
    if not isinstance(e, ShardEntry):
        raise TypeError(f"entries[{i}] must be a ShardEntry, got {type(e).__name__}")
    where = f"entries[{i}] ({e.name!r})"
    if not isinstance(e.name, str) or not e.name:
        raise ValueError(f"entries[{i}].name must be a non-empty str, got {e.name!r}")
    if not isinstance(e.tensor, torch.Tensor):
        raise TypeError(f"{where}: tensor must be a torch.Tensor, got {type(e.tensor).__name__}")
    if e.tensor.dtype not in SAFETENSORS_DTYPES:
        raise ValueError(
            f"{where}: dtype {e.tensor.dtype} cannot be saved; use one of "
            f"{', '.join(str(d) for d in SAFETENSORS_DTYPES)}"
        )
    shape, offsets = tuple(e.global_shape), tuple(e.offsets)
    if any(not isinstance(d, int) or d < 0 for d in (*shape, *offsets)):
        raise ValueError(f"{where}: global_shape and offsets must be ints >= 0, got {e.box}")
    if len(offsets) != len(shape) or e.tensor.dim() != len(shape):
        raise ValueError(
            f"{where}: a box has one offset and one tensor dim per dim of global_shape "
            f"{shape}; got offsets {offsets} and tensor shape {tuple(e.tensor.shape)} "
            f"(for a flat range use entries_of_flat_range)"
        )
    for o, s, d in zip(offsets, e.tensor.shape, shape):
        if o + s > d:
            raise ValueError(
                f"{where}: box at offsets {offsets} of shape {tuple(e.tensor.shape)} must lie "
                f"within global_shape {shape}"
            )


def entries_of_flat_range(
    name: str, global_shape: tuple[int, ...], start: int, flat: torch.Tensor
) -> list[ShardEntry]:
    """Entries for flat elements ``[start, start + flat.numel())`` of a row-major tensor
    (``flat`` is 1-D): one per box of :func:`flat_range_boxes`, viewing ``flat`` (no copy)."""
    if flat.dim() != 1:
        raise ValueError(f"{name!r}: flat must be 1-D, got shape {tuple(flat.shape)}")
    numel = math.prod(global_shape)
    if not 0 <= start <= start + flat.numel() <= numel:
        raise ValueError(
            f"{name!r}: range [{start}, {start + flat.numel()}) must lie within "
            f"[0, {numel}) = prod(global_shape={tuple(global_shape)})"
        )
    out = []
    for (offsets, shape), lo in flat_range_boxes(tuple(global_shape), start, start + flat.numel()):
        values = flat[lo - start : lo - start + math.prod(shape)].view(shape)
        out.append(ShardEntry(name, tuple(global_shape), offsets, values))
    return out


def prepare_entries(entries: list[ShardEntry], copy: bool = False) -> list[ShardEntry]:
    """Check ``entries`` and return them as contiguous CPU tensors with tuple shapes (an empty
    box stores nothing but names its tensor, so a tensor of zero elements is still saved).

    Args:
        entries: this rank's boxes.
        copy: clone every tensor (a snapshot the caller may keep mutating), not only the ones
            that had to move to the host or be made contiguous.

    Raises:
        ValueError/TypeError naming the bad entry: a box outside the global tensor, dims that do
        not match, an unsupported dtype, or two boxes of one name at the same offsets.
    """
    out: list[ShardEntry] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for i, e in enumerate(entries):
        _check_entry(i, e)
        if e.tensor.numel() and (e.name, tuple(e.offsets)) in seen:
            raise ValueError(
                f"entries[{i}]: {e.name!r} has two boxes at offsets {tuple(e.offsets)} on "
                f"this rank; give each box once"
            )
        if e.tensor.numel():
            seen.add((e.name, tuple(e.offsets)))
        t = e.tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        elif copy:
            t = t.clone()
        shape = tuple(int(d) for d in e.global_shape)
        out.append(ShardEntry(e.name, shape, tuple(int(o) for o in e.offsets), t.contiguous()))
    return out

"""Saved entries are boxes with n-d offsets: a flat range is a few boxes, a row- or
column-parallel shard is one, and a checkpoint of any layout reads back in any other."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise import comm
from shardwise.checkpoint import (
    CheckpointReader,
    ShardEntry,
    entries_of_flat_range,
    flat_range_boxes,
    save_checkpoint,
)

FULL = torch.arange(6 * 10 * 4, dtype=torch.float32).reshape(6, 10, 4)


@pytest.fixture(scope="module", autouse=True)
def world() -> Iterator[None]:
    shardwise.init(backend="gloo")
    yield
    shardwise.shutdown()  # the next init forms a fresh world, with fresh groups


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 5), (4, 1, 3, 2), (0, 3)])
def test_flat_range_boxes_are_the_range_in_order(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    full = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            boxes = flat_range_boxes(shape, start, stop)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            got = [
                full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                for (off, size), _ in boxes
            ]
            flat = torch.cat(got) if got else torch.empty(0, dtype=torch.int64)
            assert torch.equal(flat, torch.arange(start, stop)), (shape, start, stop)
            assert [lo for _, lo in boxes] == [
                start + sum(len(g) for g in got[:i]) for i in range(len(got))
            ]


def _split(dim: int, parts: int) -> list[ShardEntry]:
    """FULL split into ``parts`` boxes along ``dim`` (e.g. tensor-parallel shards)."""
    out, step = [], -(-FULL.shape[dim] // parts)
    for lo in range(0, FULL.shape[dim], step):
        piece = FULL.narrow(dim, lo, min(step, FULL.shape[dim] - lo))
        offsets = tuple(lo if d == dim else 0 for d in range(FULL.dim()))
        out.append(ShardEntry("w", tuple(FULL.shape), offsets, piece.clone()))
    return out


def _zero(parts: int) -> list[ShardEntry]:
    """FULL as ``parts`` flat ranges (ZeRO shards), each as its boxes."""
    n, out = FULL.numel(), []
    for i in range(parts):
        lo, hi = n * i // parts, n * (i + 1) // parts
        out += entries_of_flat_range("w", tuple(FULL.shape), lo, FULL.reshape(-1)[lo:hi].clone())
    return out


LAYOUTS = {
    "rows/3": lambda: _split(0, 3),
    "cols/4": lambda: _split(1, 4),
    "last/2": lambda: _split(2, 2),
    "zero/7": lambda: _zero(7),
}


@pytest.mark.parametrize("saved", sorted(LAYOUTS))
def test_any_layout_reads_back_in_any_other(tmp_path: Path, saved: str) -> None:
    save_checkpoint(tmp_path, 1, LAYOUTS[saved](), {}, None, group=comm.world())
    with CheckpointReader(tmp_path) as reader:
        assert reader.global_shape("w") == tuple(FULL.shape)
        assert torch.equal(reader.read_full("w"), FULL)
        for name, make in LAYOUTS.items():  # every box of every layout, read from this one
            for e in make():
                got = reader.read_box("w", e.offsets, tuple(e.tensor.shape))
                assert torch.equal(got, e.tensor), (saved, name, e.offsets)
        for lo, hi in [(0, 240), (5, 77), (39, 41), (100, 100)]:
            assert torch.equal(reader.read_range("w", lo, hi), FULL.reshape(-1)[lo:hi])
        with pytest.raises(ValueError, match="must lie within"):
            reader.read_box("w", (5, 0, 0), (2, 10, 4))


def test_overlapping_and_missing_boxes_are_refused(tmp_path: Path) -> None:
    rows = _split(0, 3)
    shifted = ShardEntry("w", tuple(FULL.shape), (1, 0, 0), rows[0].tensor)  # rows 1-2 twice
    with pytest.raises(ValueError, match="overlap"):
        save_checkpoint(tmp_path, 1, [*rows, shifted], {}, None, group=comm.world())
    with pytest.raises(ValueError, match=r"elements \[80, 160\) are held by no rank"):
        save_checkpoint(tmp_path, 1, [rows[0], rows[2]], {}, None, group=comm.world())

"""One box of a stored tensor read from its file with positioned reads, nothing mapped.

A box of a row-major tensor is a set of contiguous runs: past the last dimension where the box
is narrower than the tensor, every run spans the rest whole. Each run is read straight into the
box's own buffer (``os.preadv``), so the process holds the box and nothing else: no
memory-mapped file, which a per-process data limit (``RLIMIT_DATA``) would count whole.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from shardwise.hf.errors import WeightsError
from shardwise.hf.header import TensorInfo

__all__ = ["read_box_from"]


def _runs(
    full: tuple[int, ...], offsets: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[list[int], int]:
    """The start (in elements, in the whole tensor) of every contiguous run of the box, in the
    box's row-major order, and the run length."""
    j = len(full) - 1
    while j > 0 and offsets[j] == 0 and shape[j] == full[j]:
        j -= 1
    strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
    if not full:
        return [0], 1
    length = shape[j] * strides[j]
    base = offsets[j] * strides[j]
    leading = [range(o, o + s) for o, s in zip(offsets[:j], shape[:j])]
    starts = [
        base + sum(i * strides[d] for d, i in enumerate(idx)) for idx in itertools.product(*leading)
    ]
    return starts, length


def read_box_from(
    fd: int, info: TensorInfo, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]
) -> torch.Tensor:
    """The box of stored tensor ``name`` (described by ``info``) at ``offsets`` with ``shape``,
    in its stored dtype, read from the open file ``fd``.

    Raises:
        WeightsError: naming the file and tensor when the file ends early.
    """
    out = torch.empty(shape, dtype=info.dtype)
    item = info.dtype.itemsize
    view = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    starts, length = _runs(info.shape, offsets, shape)
    size = length * item
    for k, start in enumerate(starts):
        got = os.preadv(fd, [view[k * size : (k + 1) * size]], info.begin + start * item)
        if got != size:
            raise WeightsError(
                f"the file ended after {got} of {size} bytes at offset "
                f"{info.begin + start * item}: it was truncated or changed while being read",
                info.file,
                name,
            )
    return out

"""What the training engine hands to a save: this rank's flat pieces of logical tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardwise.checkpoint.shardfile import SAFETENSORS_DTYPES


@dataclass
class ShardEntry:
    """One rank's contiguous range of one logical tensor.

    Over all ranks of a save, the entries of a logical tensor must cover its flat elements
    ``[0, prod(full_shape))`` exactly once. A replicated tensor is either split into disjoint
    ranges by the engine or given by a single rank.
    """

    name: str
    """Logical tensor name, e.g. ``model/blocks.0.attn.qkv.weight`` or ``optim/<param>/exp_avg``."""
    full_shape: tuple[int, ...]
    """Shape of the whole (unsharded) tensor."""
    start: int
    """Flat element offset of this piece within the full tensor flattened row-major."""
    tensor: torch.Tensor
    """1-D tensor holding elements ``[start, start + numel)``; CUDA tensors are copied to host."""

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def stop(self) -> int:
        return self.start + self.tensor.numel()


def _check_entry(i: int, e: object) -> None:
    if not isinstance(e, ShardEntry):
        raise TypeError(f"entries[{i}] must be a ShardEntry, got {type(e).__name__}")
    where = f"entries[{i}] ({e.name!r})"
    if not isinstance(e.name, str) or not e.name:
        raise ValueError(f"entries[{i}].name must be a non-empty str, got {e.name!r}")
    if not isinstance(e.tensor, torch.Tensor):
        raise TypeError(f"{where}: tensor must be a torch.Tensor, got {type(e.tensor).__name__}")
    if e.tensor.dim() != 1:
        raise ValueError(
            f"{where}: tensor must be 1-D (flatten it with .reshape(-1)), got "
            f"shape {tuple(e.tensor.shape)}"
        )
    if e.tensor.dtype not in SAFETENSORS_DTYPES:
        raise ValueError(
            f"{where}: dtype {e.tensor.dtype} cannot be saved; use one of "
            f"{', '.join(str(d) for d in SAFETENSORS_DTYPES)}"
        )
    if any(not isinstance(d, int) or d < 0 for d in e.full_shape):
        raise ValueError(f"{where}: full_shape must be non-negative ints, got {e.full_shape}")
    if not isinstance(e.start, int) or e.start < 0 or e.stop > e.full_numel:
        raise ValueError(
            f"{where}: range [{e.start}, {e.stop}) must lie within "
            f"[0, {e.full_numel}) = prod(full_shape={tuple(e.full_shape)})"
        )


def prepare_entries(entries: list[ShardEntry], copy: bool = False) -> list[ShardEntry]:
    """Check ``entries`` and return them as contiguous CPU tensors with tuple shapes.

    Args:
        entries: this rank's pieces.
        copy: clone every tensor (a snapshot the caller may keep mutating), not only the ones
            that had to move to the host or be made contiguous.

    Raises:
        ValueError/TypeError naming the bad entry: not 1-D, unsupported dtype, a range outside the
        full tensor, or two pieces of one name with the same start on this rank.
    """
    out: list[ShardEntry] = []
    seen: set[tuple[str, int]] = set()
    for i, e in enumerate(entries):
        _check_entry(i, e)
        if e.tensor.numel() and (e.name, e.start) in seen:  # empty pieces are not stored
            raise ValueError(
                f"entries[{i}]: {e.name!r} has two pieces starting at {e.start} on "
                f"this rank; give each range once"
            )
        if e.tensor.numel():
            seen.add((e.name, e.start))
        t = e.tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        elif copy:
            t = t.clone()
        out.append(ShardEntry(e.name, tuple(int(d) for d in e.full_shape), e.start, t.contiguous()))
    return out

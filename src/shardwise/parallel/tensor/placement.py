"""Where each parameter of a tensor-parallel model lives along the tp axis.

A parameter is either sharded over tp along one dim (each rank holds ``ceil(n / tp)`` rows of
that dim; a vocabulary that does not divide by tp is zero-padded at the end, the padding never
leaves this package) or replicated over tp. A replicated parameter used inside a
sequence-parallel region sees only this rank's slice of the sequence, so its gradient is a
partial sum that is all-reduced over tp in backward (``partial=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPPlacement:
    """One parameter's layout along the tp axis."""

    name: str
    """The parameter's name in the original model (first name if it is tied)."""
    full_shape: tuple[int, ...]
    """Shape of the unsharded parameter, without padding."""
    dim: int | None
    """The sharded dim, or None when the parameter is replicated over tp."""
    tp_size: int
    """Degree of the tp axis."""
    tp_rank: int
    """This rank's position on the tp axis."""
    partial: bool = False
    """Replicated, but its gradient is a partial sum over tp (sequence-parallel region)."""

    @property
    def sharded(self) -> bool:
        return self.dim is not None and self.tp_size > 1

    @property
    def chunk(self) -> int:
        """Rows of the sharded dim each rank holds (padding included)."""
        assert self.dim is not None
        return math.ceil(self.full_shape[self.dim] / self.tp_size)

    @property
    def padded(self) -> bool:
        return self.sharded and self.full_shape[self.dim] % self.tp_size != 0  # type: ignore[index]

    def owned_range(self, tp_rank: int | None = None) -> tuple[int, int]:
        """``[start, stop)`` of the real (unpadded) rows ``tp_rank`` holds along ``dim``."""
        assert self.dim is not None
        r = self.tp_rank if tp_rank is None else tp_rank
        n = self.full_shape[self.dim]
        start = min(r * self.chunk, n)
        return start, min(start + self.chunk, n)

    def local_shape(self) -> tuple[int, ...]:
        if not self.sharded:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.chunk  # type: ignore[index]
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (zero rows appended where the dim is padded)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"{self.name}: expected a full tensor of shape {self.full_shape}, "
                f"got {tuple(full.shape)}"
            )
        if not self.sharded:
            return full.detach().clone()
        assert self.dim is not None
        start, stop = self.owned_range()
        out = full.new_zeros(self.local_shape())
        out.narrow(self.dim, 0, stop - start).copy_(full.narrow(self.dim, start, stop - start))
        return out

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """Drop the padding of a tensor gathered from every rank's shard along ``dim``."""
        assert self.dim is not None
        return gathered.narrow(self.dim, 0, self.full_shape[self.dim])

"""Which tokens of a sequence each cp rank holds, and where they sit in the whole sequence.

Causal attention makes later tokens costlier (they see more keys), so a rank holding one
contiguous slice would idle while the last rank works. The sequence is therefore cut into
``2 * cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` (one early,
one late), which gives every rank the same number of unmasked query-key pairs (Liu et al.
2023, ring attention; the same balance as torch's ``_attention.py`` and Megatron-Core).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """The load-balanced split of a sequence over ``cp_size`` ranks, seen from ``cp_rank``."""

    cp_size: int
    cp_rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank={self.cp_rank} is outside cp_size={self.cp_size}")

    def check_length(self, seq_len: int) -> int:
        """The chunk length for a whole sequence of ``seq_len`` tokens; ValueError unless it
        divides by ``2 * cp``."""
        parts = 2 * self.cp_size
        if seq_len % parts:
            raise ValueError(
                f"a sequence of {seq_len} tokens does not split over cp={self.cp_size}: its length "
                f"must divide by 2 * cp = {parts} (pad it to {-(-seq_len // parts) * parts})"
            )
        return seq_len // parts

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank ``rank`` holds (early, late)."""
        return rank, 2 * self.cp_size - 1 - rank

    def positions_of(self, rank: int, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions (int64 [local_len]) of the tokens rank ``rank`` holds, when every
        rank holds ``local_len`` tokens."""
        if local_len % 2:
            raise ValueError(f"a cp rank's {local_len} tokens are not two equal chunks")
        chunk = local_len // 2
        a, b = self.chunks_of(rank)
        ar = torch.arange(chunk, device=device)
        return torch.cat([ar + a * chunk, ar + b * chunk])

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """This rank's global positions (int64 [local_len])."""
        return self.positions_of(self.cp_rank, local_len, device)

    def split(self, full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``full`` (the whole sequence along ``dim``), in the order of
        ``positions``. ``[batch, seq, ...] -> [batch, seq / cp, ...]``."""
        chunk = self.check_length(full.shape[dim])
        parts = full.split(chunk, dim=dim)
        a, b = self.chunks_of(self.cp_rank)
        return torch.cat([parts[a], parts[b]], dim=dim)

    def merge(self, locals_: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's ``split`` (in cp-rank order): its inverse."""
        if len(locals_) != self.cp_size:
            raise ValueError(f"merge needs {self.cp_size} pieces, got {len(locals_)}")
        parts: list[torch.Tensor | None] = [None] * (2 * self.cp_size)
        for rank, piece in enumerate(locals_):
            early, late = piece.chunk(2, dim=dim)
            a, b = self.chunks_of(rank)
            parts[a], parts[b] = early, late
        return torch.cat([p for p in parts if p is not None], dim=dim)

"""Stage 3: check once per step that every rank gathered the same buffers in the same order.

Gathers are started by module calls, so a unit called on some ranks only (a data-dependent
branch, an expert routed on one rank) pairs one rank's all_gather with another buffer's on
another rank. When the sizes match nothing fails there, and the parameters are silently wrong.
Each rank folds the sequence of buffers it gathered into a 64-bit hash; the step carries the hash
and its complement, byte by byte, in the all_reduce (max) of the used map (``zero.step``): the
ranks agree exactly when, in every byte, max(h) + max(~h) == 255. Otherwise the step raises
before anything is updated, naming the units this rank gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HASH_BYTES = 8
_MASK = (1 << 64) - 1
_KEEP = 64  # names kept for the error message


class GatherLog:
    """The buffers gathered since the last step, shared by the flat buffers of one model."""

    def __init__(self, flats: Sequence[object], labels: list[str]) -> None:
        self._index = {id(f): i for i, f in enumerate(flats)}
        self._labels = labels
        self.hash = 0
        self.names: list[str] = []

    def record(self, flat: object) -> None:
        i = self._index[id(flat)]
        self.hash = (self.hash * 1_000_003 + i + 1) & _MASK
        if len(self.names) < _KEEP:
            self.names.append(self._labels[i])

    def reset(self) -> None:
        self.hash = 0
        self.names.clear()

    def lanes(self) -> list[int]:
        """The hash and its complement as bytes, for an all_reduce with max."""
        raw = list(self.hash.to_bytes(HASH_BYTES, "little"))
        return raw + [255 - b for b in raw]

    def check(self, reduced: torch.Tensor | list[int]) -> None:
        """``reduced``: ``lanes()`` after the all_reduce (max) over the ranks."""
        values = [int(v) for v in reduced]
        high, low = values[:HASH_BYTES], values[HASH_BYTES:]
        if all(h + c == 255 for h, c in zip(high, low)):
            return
        names = ", ".join(dict.fromkeys(self.names)) or "none"
        raise RuntimeError(
            "ZeRO-3: the ranks gathered different units in this step (a unit called on some "
            "ranks only, e.g. a data-dependent branch or an expert routed on one rank), so "
            "parameters were paired with another rank's shards of a different unit; nothing was "
            f"updated. This rank gathered, in order: {names}. Put modules that run on some "
            "ranks only inside a unit every rank calls (a coarser wrap_policy naming their "
            "parent's class, or no wrap_policy)."
        )

"""The order of fine-tuning examples: shuffled per epoch, sliced by data-parallel rank, and
resumable exactly.

Epoch ``e`` visits every example once in a permutation drawn from ``(seed, e)``; with packing,
that order is then cut into rows (``packing.pack_rows``), so an epoch's row count may differ
from the next one's. Rows of all epochs form one endless sequence; global batch ``s`` is its
``s``-th run of ``micro_batch * grad_accum * dp_size`` rows, dp rank ``r`` reading the
``r``-th contiguous part as ``grad_accum`` micro-batches. Every rank computes the same order
locally (no communication). ``state_dict`` holds the position as small ints, so a resumed run
reads exactly the rows the uninterrupted one would have read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.data.sampler import check_counts

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, epoch) over generator seeds

RowsOf = Callable[[list[int]], list[list[int]]]
"""An epoch's example order -> its rows (lists of example indices)."""


def single_rows(order: list[int]) -> list[list[int]]:
    """Without packing: one example a row."""
    return [[i] for i in order]


class ExampleSampler:
    """Yields this dp rank's micro-batches as rows of example indices.

    Args:
        num_examples: examples in the dataset.
        micro_batch: rows per forward on this rank.
        dp_rank, dp_size: this rank's place on the data-parallel axis.
        seed: seed of the per-epoch permutations.
        grad_accum: micro-batches per rank per optimizer step.
        rows_of: how an epoch's order becomes rows (default: one example a row).
        fingerprint: identifies the prepared data (checked on resume).
    """

    def __init__(
        self,
        num_examples: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        *,
        seed: int = 0,
        grad_accum: int = 1,
        rows_of: RowsOf = single_rows,
        fingerprint: str = "",
    ) -> None:
        check_counts(
            dp_rank,
            dp_size,
            num_examples=num_examples,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
        )
        self.num_examples, self.seed, self.fingerprint = num_examples, seed, fingerprint
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch_size = micro_batch * grad_accum * dp_size
        self.rows_of = rows_of
        self._epoch = 0  # epoch and row where the current global batch starts
        self._position = 0
        self._micro_step = 0
        self._rows: dict[int, list[list[int]]] = {}

    def rows(self, epoch: int) -> list[list[int]]:
        """The rows of ``epoch``, in order."""
        rows = self._rows.get(epoch)
        if rows is None:
            gen = torch.Generator().manual_seed((self.seed * _SEED_MIX + epoch) % 2**63)
            order = torch.randperm(self.num_examples, generator=gen).tolist()
            rows = self.rows_of(order)
            if len(self._rows) >= 2:  # a batch spans at most a few epochs; keep memory flat
                self._rows.pop(min(self._rows))
            self._rows[epoch] = rows
        return rows

    def _take(self, skip: int, count: int) -> list[list[int]]:
        """``count`` rows starting ``skip`` rows after the current global batch's start."""
        epoch, pos = self._epoch, self._position + skip
        out: list[list[int]] = []
        while len(out) < count:
            rows = self.rows(epoch)
            if pos >= len(rows):
                epoch, pos = epoch + 1, pos - len(rows)
                continue
            take = rows[pos : pos + count - len(out)]
            out += take
            pos += len(take)
        return out

    @property
    def epoch(self) -> int:
        """Epoch the current global batch starts in."""
        return self._epoch

    def next_batch(self) -> list[list[int]]:
        """This rank's next micro-batch: ``micro_batch`` rows of example indices."""
        per_rank = self.micro_batch * self.grad_accum
        skip = self.dp_rank * per_rank + self._micro_step * self.micro_batch
        batch = self._take(skip, self.micro_batch)
        self._micro_step += 1
        if self._micro_step == self.grad_accum:
            self._micro_step = 0
            self._advance(self.global_batch_size)
        return batch

    def global_batch(self) -> list[list[int]]:
        """The rows of the current global batch, all ranks' in rank order (does not move)."""
        return self._take(0, self.global_batch_size)

    def _advance(self, count: int) -> None:
        pos = self._position + count
        while pos >= len(self.rows(self._epoch)):
            pos -= len(self.rows(self._epoch))
            self._epoch += 1
        self._position = pos

    def state_dict(self) -> dict[str, int | str]:
        """Where the sampler is, to resume with ``load_state_dict``."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "micro_step": self._micro_step,
            "seed": self.seed,
            "num_examples": self.num_examples,
            "global_batch_size": self.global_batch_size,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Continue from ``state_dict()``: the next batch is the one that would have come.
        The data, seed and global batch size must be the saved run's."""
        for key in ("seed", "num_examples", "fingerprint", "global_batch_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"the saved data position is for {key}={state.get(key)!r}, this run has "
                    f"{getattr(self, key)!r}: resume with the same data, seed, --seq-len, "
                    "--packing and batch shape"
                )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._micro_step = int(state["micro_step"])

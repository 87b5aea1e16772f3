"""Deterministic batches for data parallelism: one global order, sliced by data-parallel rank.

The token stream is cut into non-overlapping windows of ``seq_len`` input tokens (each also
reads the next token as its last target). Every epoch visits all windows once, in a permutation
drawn from ``(seed, epoch)``. Global batch ``s`` is the ``s``-th run of ``global_batch_size``
windows of that endless sequence, so it holds the same sequences at any ``dp_size`` as long as
``micro_batch * grad_accum * dp_size`` stays the same.
"""

from __future__ import annotations

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, epoch) over generator seeds


def check_counts(dp_rank: int, dp_size: int, **counts: int) -> None:
    """Refuse a count below 1 (or not an int) and a dp rank outside the dp size, naming it."""
    for name, value in {**counts, "dp_size": dp_size}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: set it to an int >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")


class DistributedBatchSampler:
    """Yields this data-parallel rank's micro-batches of ``(inputs, targets)``.

    A global batch has ``micro_batch * grad_accum * dp_size`` sequences. Rank ``r`` owns the
    ``r``-th contiguous slice of ``micro_batch * grad_accum`` of them and reads it as
    ``grad_accum`` successive micro-batches. No communication: every rank computes the same
    order locally.

    Args:
        tokens: 1-D token ids (e.g. ``Corpus.train``).
        seq_len: Tokens per input sequence.
        micro_batch: Sequences per forward on this rank.
        dp_rank: This rank's index along the data-parallel axis.
        dp_size: Number of data-parallel ranks.
        seed: Seed of the per-epoch permutations.
        grad_accum: Micro-batches per rank per optimizer step.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        grad_accum: int = 1,
    ) -> None:
        check_counts(
            dp_rank, dp_size, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum
        )
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"corpus of {tokens.numel()} tokens is shorter than one sequence of seq_len + 1 = "
                f"{seq_len + 1}: lower seq_len or use a larger corpus"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.grad_accum = grad_accum
        self.num_windows = (tokens.numel() - 1) // seq_len
        self.global_batch_size = micro_batch * grad_accum * dp_size
        self._cursor = 0  # index in the endless window sequence where the current batch starts
        self._micro_step = 0  # micro-batches of the current global batch already returned
        self._perms: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed((self.seed * _SEED_MIX + epoch) % 2**63)
            perm = torch.randperm(self.num_windows, generator=gen)
            if len(self._perms) >= 2:  # a batch spans at most a few epochs; keep memory flat
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def _windows(self, start: int, count: int) -> torch.Tensor:
        """Window ids at positions [start, start + count) of the endless sequence."""
        parts = []
        while count > 0:
            epoch, pos = divmod(start, self.num_windows)
            take = min(count, self.num_windows - pos)
            parts.append(self._permutation(epoch)[pos : pos + take])
            start, count = start + take, count - take
        return torch.cat(parts)

    def _gather(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = self._windows(start, count) * self.seq_len  # [count]
        span = torch.arange(self.seq_len + 1)
        index = (offsets[:, None] + span[None, :]).to(self.tokens.device)
        seqs = self.tokens[index].long()  # [count, seq_len + 1]
        return seqs[:, :-1], seqs[:, 1:]

    @property
    def epoch(self) -> int:
        """Epoch the next global batch starts in."""
        return self._cursor // self.num_windows

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and targets, int64 [micro_batch, seq_len].

        Targets are the inputs shifted by one token. After ``grad_accum`` calls the sampler
        moves to the next global batch.
        """
        per_rank = self.micro_batch * self.grad_accum
        start = self._cursor + self.dp_rank * per_rank + self._micro_step * self.micro_batch
        batch = self._gather(start, self.micro_batch)
        self._micro_step += 1
        if self._micro_step == self.grad_accum:
            self._micro_step = 0
            self._cursor += self.global_batch_size
        return batch

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch number ``step`` of a run from the start: all ranks' parts in rank order.

        Returns inputs and targets, int64 [global_batch_size, seq_len]; does not move the
        sampler. Rank ``r``'s micro-batch ``m`` of that step is rows
        ``(r * grad_accum + m) * micro_batch`` onwards.
        """
        if step < 0:
            raise ValueError(f"step={step}: set it to an int >= 0")
        return self._gather(step * self.global_batch_size, self.global_batch_size)

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is, to resume with ``load_state_dict``: small ints only."""
        epoch, position = divmod(self._cursor, self.num_windows)
        return {
            "epoch": epoch,
            "position": position,
            "micro_step": self._micro_step,
            "seed": self.seed,
            "num_windows": self.num_windows,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from ``state_dict()`` output so the next batch is the one that would have come.

        The data (window count) and seed must match. Resuming at another ``dp_size`` works at a
        global-batch boundary; mid-accumulation it needs the same global batch size.
        """
        if state["seed"] != self.seed or state["num_windows"] != self.num_windows:
            raise ValueError(
                f"sampler state is for seed={state['seed']} over {state['num_windows']} windows, "
                f"this sampler has seed={self.seed} over {self.num_windows}: use the same corpus, "
                "seq_len and seed as the saved run"
            )
        if state["micro_step"] and (
            state["global_batch_size"] != self.global_batch_size
            or state["micro_step"] >= self.grad_accum
        ):
            raise ValueError(
                f"sampler state stopped at micro-step {state['micro_step']} of a global batch of "
                f"{state['global_batch_size']}: resume with the same micro_batch, grad_accum and "
                "dp_size, or from a global-batch boundary"
            )
        self._cursor = state["epoch"] * self.num_windows + state["position"]
        self._micro_step = state["micro_step"]

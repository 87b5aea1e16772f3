"""From a data file to batches: read, render, prepare, order, collate, in one object."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.sft.collator import Batch, Collator
from shardwise.sft.data import DataError, read_dataset
from shardwise.sft.packing import pack_rows, prepare
from shardwise.sft.render import Tokenized, check_tokenizer, pad_id, render
from shardwise.sft.sampler import ExampleSampler, single_rows


@dataclass(frozen=True)
class TrainingData:
    """A dataset ready to batch, and what reading and preparing it changed."""

    examples: list[Tokenized]
    collator: Collator
    packing: bool
    seq_len: int
    skipped: int
    """Malformed records skipped (``skip_bad_lines``)."""
    truncated: int
    """Examples cut to ``seq_len``."""
    dropped: int
    """Examples with no labelled token left, left out."""

    @property
    def fingerprint(self) -> str:
        """A digest of the prepared tokens and labels (a resume checks it is the same data)."""
        h = hashlib.sha256()
        for ex in self.examples:
            h.update(repr((ex.input_ids, ex.labels)).encode())
        return h.hexdigest()[:16]

    def rows_of(self, order: list[int]) -> list[list[int]]:
        """An epoch's order as rows: packed to ``seq_len``, or one example each."""
        if not self.packing:
            return single_rows(order)
        return pack_rows([len(e) for e in self.examples], order, self.seq_len)

    def sampler(
        self, micro_batch: int, dp_rank: int, dp_size: int, *, seed: int = 0, grad_accum: int = 1
    ) -> ExampleSampler:
        """The resumable order of this data for one dp rank."""
        return ExampleSampler(
            len(self.examples),
            micro_batch,
            dp_rank,
            dp_size,
            seed=seed,
            grad_accum=grad_accum,
            rows_of=self.rows_of,
            fingerprint=self.fingerprint,
        )

    def batch(self, rows: list[list[int]]) -> Batch:
        return self.collator(rows)

    def report(self) -> str:
        """What preparing changed, in one line (truncation is never silent)."""
        return (
            f"{len(self.examples)} examples; {self.truncated} truncated to --seq-len "
            f"{self.seq_len}, {self.dropped} left out with nothing to learn, "
            f"{self.skipped} malformed records skipped"
        )


def load_training_data(
    path: Path | str,
    tokenizer: Any,
    *,
    seq_len: int,
    packing: bool = False,
    train_on_prompt: bool = False,
    skip_bad_lines: bool = False,
) -> TrainingData:
    """Read ``path``, render every example with ``tokenizer`` and prepare it for ``seq_len``.
    Raises ``DataError`` (a ``ValueError``) naming the problem: a bad record, an empty
    dataset, no chat template for ``messages``, nothing left to learn after truncation."""
    data = read_dataset(path, skip_bad_lines=skip_bad_lines)
    check_tokenizer(tokenizer, needs_chat=any(e.kind == "messages" for e in data.examples))
    do = functools.partial(render, tokenizer=tokenizer, train_on_prompt=train_on_prompt)
    prepared = prepare([do(e) for e in data.examples], seq_len)
    if not prepared.examples:
        raise DataError(
            f"{path}: every example has all its labels masked after truncating to --seq-len "
            f"{seq_len}: raise --seq-len or pass --train-on-prompt"
        )
    pad = pad_id(tokenizer)
    assert pad is not None  # check_tokenizer
    collator = Collator(prepared.examples, pad, packing=packing, seq_len=seq_len)
    return TrainingData(
        prepared.examples,
        collator,
        packing,
        seq_len,
        data.skipped,
        prepared.truncated,
        prepared.dropped,
    )

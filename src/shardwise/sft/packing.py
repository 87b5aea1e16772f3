"""Sequences of the right length: truncation (reported), and packing several examples into one
row whose attention never crosses an example boundary.

A packed row holds consecutive examples of the epoch's order while they fit in ``seq_len``
tokens. Position ids restart at 0 for each example, each example's first label is dropped (it
would be predicted from the previous example's last token), and the attention mask is
block-diagonal and causal: a token sees only earlier tokens of its own example. Padding at the
end of a row sees only itself (a fully masked row would give NaN in softmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.sft.render import IGNORE, Tokenized


@dataclass(frozen=True)
class Prepared:
    """Examples ready to batch, and what preparing them changed (reported to the user)."""

    examples: list[Tokenized]
    truncated: int = 0
    """Examples cut to ``seq_len`` tokens."""
    dropped: int = 0
    """Examples left with no token to learn from (all labels masked, e.g. a prompt longer than
    ``seq_len``), left out."""


def trainable_tokens(example: Tokenized) -> int:
    """Tokens the loss is taken on: labels past the first (the first has nothing before it)."""
    return sum(1 for t in example.labels[1:] if t != IGNORE)


def prepare(examples: list[Tokenized], seq_len: int) -> Prepared:
    """Cut every example to ``seq_len`` tokens and leave out those with nothing to learn."""
    kept: list[Tokenized] = []
    truncated = dropped = 0
    for ex in examples:
        if len(ex) > seq_len:
            ex = Tokenized(ex.input_ids[:seq_len], ex.labels[:seq_len])
            truncated += 1
        if trainable_tokens(ex) == 0:
            dropped += 1
            continue
        kept.append(ex)
    return Prepared(kept, truncated, dropped)


def pack_rows(lengths: list[int], order: list[int], seq_len: int) -> list[list[int]]:
    """Rows of example indices: ``order`` cut greedily into runs whose lengths sum to at most
    ``seq_len`` (every length is at most ``seq_len``)."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for i in order:
        if row and used + lengths[i] > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += lengths[i]
    if row:
        rows.append(row)
    return rows


@dataclass(frozen=True)
class PackedRow:
    """One packed row's tensors, each ``[seq_len]``."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    """Which example each token belongs to (1, 2, ...); padding: ``-1 - position`` (its own)."""


def pack(examples: list[Tokenized], seq_len: int, pad_id: int) -> PackedRow:
    """Concatenate ``examples`` (their lengths summing to at most ``seq_len``) into one row."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    segments: list[int] = []
    for number, ex in enumerate(examples, start=1):
        ids += ex.input_ids
        labels += [IGNORE, *ex.labels[1:]]  # never predicted across the boundary
        positions += range(len(ex))
        segments += [number] * len(ex)
    if len(ids) > seq_len:
        raise ValueError(f"examples of {len(ids)} tokens do not fit a row of {seq_len}")
    pad = seq_len - len(ids)
    start = len(ids)
    return PackedRow(
        torch.tensor(ids + [pad_id] * pad),
        torch.tensor(labels + [IGNORE] * pad),
        torch.tensor(positions + list(range(pad))),
        torch.tensor(segments + [-1 - (start + k) for k in range(pad)]),
    )


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask ``[batch, 1, seq, seq]`` (True: may attend) from segment ids
    ``[batch, seq]``: query ``q`` sees key ``k`` iff ``k <= q`` and both are of one example."""
    seq = segments.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    same = segments[:, :, None] == segments[:, None, :]  # [batch, seq, seq]
    return (same & causal)[:, None]

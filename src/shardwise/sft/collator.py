"""Rows of examples to model inputs, and the loss on them.

Without packing a micro-batch is padded on the right to its longest example, with a 2-D
attention mask and the padding's labels ignored. With packing every row is ``seq_len`` tokens
of whole examples (``packing.pack``) with a 4-D block-diagonal causal mask and position ids
restarting per example; CPU attention (SDPA) has no variable-length kernel, so the mask is
what keeps examples apart. The loss is a sum over labelled tokens, divided by the number of
labelled tokens in the whole global batch (all micro-batches, all dp ranks), so a step's loss
and gradient are the token mean of the global batch at any data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.sft.packing import block_causal_mask, pack
from shardwise.sft.render import IGNORE, Tokenized


@dataclass(frozen=True)
class Batch:
    """One micro-batch, every tensor ``[rows, seq]``; ``attention_mask`` ``[rows, seq]``
    (padding) or ``[rows, 1, seq, seq]`` (packing, True: may attend)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None = None

    def model_inputs(self, attn_implementation: str | None = "sdpa") -> dict[str, Any]:
        """Keyword arguments of a Hugging Face causal LM's forward (labels left out: the loss
        is taken outside). Eager attention adds the mask, so it gets 0 / -inf-like floats."""
        mask = self.attention_mask
        if mask.dim() == 4 and attn_implementation == "eager":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "attention_mask": mask}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def label_count(self) -> int:
        """Tokens the loss is taken on (labels after the shift)."""
        return int((self.labels[:, 1:] != IGNORE).sum())


class Collator:
    """Builds micro-batches from rows of example indices (``ExampleSampler.next_batch``).

    Args:
        examples: the prepared examples (``packing.prepare``).
        pad_id: the padding token.
        packing: rows hold several examples each (``seq_len`` tokens, block-diagonal mask).
        seq_len: packed row length.
    """

    def __init__(
        self, examples: list[Tokenized], pad_id: int, *, packing: bool, seq_len: int
    ) -> None:
        self.examples, self.pad_id = examples, pad_id
        self.packing, self.seq_len = packing, seq_len

    def __call__(self, rows: list[list[int]]) -> Batch:
        if self.packing:
            packed = [
                pack([self.examples[i] for i in row], self.seq_len, self.pad_id) for row in rows
            ]
            segments = torch.stack([p.segments for p in packed])
            return Batch(
                torch.stack([p.input_ids for p in packed]),
                torch.stack([p.labels for p in packed]),
                block_causal_mask(segments),
                torch.stack([p.position_ids for p in packed]),
            )
        if any(len(row) != 1 for row in rows):
            raise ValueError("without packing every row holds one example")
        chosen = [self.examples[row[0]] for row in rows]
        width = max(len(ex) for ex in chosen)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, ex in enumerate(chosen):
            ids[r, : len(ex)] = torch.tensor(ex.input_ids)
            labels[r, : len(ex)] = torch.tensor(ex.labels)
            mask[r, : len(ex)] = 1
        return Batch(ids, labels, mask)


def nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy (fp32) of ``logits`` ``[rows, seq, vocab]`` against
    ``labels`` ``[rows, seq]`` (shifted here; ``IGNORE`` skipped)."""
    # Shift the labels, not the logits: position t predicts label t + 1 and the last position
    # predicts nothing (IGNORE). Slicing the logits instead would copy them (a non-contiguous
    # view flattened), and its backward would allocate them twice more: rows x seq x vocab
    # fp32 each time, the largest activation of a fine-tuning step.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE, reduction="sum")

"""One fine-tuning optimizer step on an engine: the loss as the token mean of the global
batch, whatever the data-parallel size and accumulation.

Each micro-batch's summed loss is divided by the labelled tokens of the whole global batch
(counted over dp with one all_reduce) and multiplied by ``dp_size * accum``, which the engine's
division by the accumulation steps and its gradient average over dp undo: the gradient is then
the global batch's token mean, as one process on the whole batch would compute.
"""

from __future__ import annotations

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group
from shardwise.engine.core import Engine
from shardwise.sft.collator import Batch, nll_sum


def global_label_count(batches: list[Batch], dp: Group) -> int:
    """Labelled tokens of the global batch: this rank's ``batches`` summed over ``dp``.
    Communicates: one all_reduce of 8 bytes over dp. Raises ``ValueError`` when it is 0."""
    count = torch.tensor([sum(b.label_count() for b in batches)], dtype=torch.int64)
    ops.all_reduce(count, op="sum", group=dp)
    if int(count[0]) == 0:
        raise ValueError(
            "every label of this step's batch is masked: the loss would be 0/0; check the data "
            "(completions or assistant turns cut by --seq-len) or pass --train-on-prompt"
        )
    return int(count[0])


def micro_losses(
    engine: Engine,
    batches: list[Batch],
    dp: Group,
    attn_implementation: str | None,
) -> list[float]:
    """Forward and backward over this rank's micro-batches of one step; returns each one's
    loss as scaled for backward (their mean over micro-batches and dp ranks is the global
    token-mean loss). The caller steps the optimizer."""
    total = global_label_count(batches, dp)
    scale = dp.size * len(batches) / total
    out = []
    for batch in batches:
        logits = engine(**batch.model_inputs(attn_implementation)).logits
        loss = nll_sum(logits, batch.labels) * scale
        engine.backward(loss)
        out.append(float(loss.detach()))
    return out

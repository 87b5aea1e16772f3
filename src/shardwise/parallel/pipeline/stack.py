"""A pipeline's layers as one module in one process: the whole model a ``PipelineModule``
splits, under the same parameter names (``layers.{i}.*``, ``tied.{key}.*``), so a checkpoint of
a pipeline engine loads into a plain ``Engine`` over it, and back.

    stack = LayerStack(layers, loss_fn, seed=0)          # the same layers and seed as the pipe
    engine = shardwise.initialize(stack, opt, cfg)
    engine.load("ckpt")                                  # saved at pp=2
    loss = engine(x, y)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from shardwise.parallel.pipeline.stage import (
    Entry,
    build_entry,
    check_entries,
    first_indices,
    run_entries,
)


class LayerStack(nn.Module):
    """Every entry of ``layers`` built in this process (a ``Tied`` module once), run in order.

    Args:
        layers: the model in order (modules, ``LayerSpec``s, ``Tied`` entries), as given to
            ``PipelineModule``.
        loss_fn: ``loss_fn(output, target)`` -> the mean loss; ``forward(x, y)`` returns it.
        seed: build layer ``i`` from ``LayerSpec`` under seed ``seed + i`` (a tied module under
            its first index), as ``PipelineModule`` does: both start from the same weights.
    """

    def __init__(
        self,
        layers: Sequence[Entry],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self._entries = check_entries(layers)
        self.loss_fn = loss_fn
        self.layers = nn.ModuleDict()
        self.tied = nn.ModuleDict()
        first = first_indices(self._entries)
        for i in range(len(self._entries)):
            build_entry(self._entries, i, self.layers, self.tied, first, seed)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """The output of the last layer; with ``y``, ``loss_fn(output, y)``."""
        out = run_entries(self._entries, range(len(self._entries)), self.layers, self.tied, x)
        if y is None:
            return out
        if self.loss_fn is None:
            raise ValueError("LayerStack was built without loss_fn: call it without a target")
        return self.loss_fn(out, y)

"""The model directory's weights under a peft model's names, for the streaming load.

A peft LoRA model names the base's tensors ``base_model.model.<name>``, and a targeted
layer's weight ``...q_proj.base_layer.weight``; the directory holds ``<name>`` and
``...q_proj.weight``. ``PeftNamedSource`` presents the directory's tensors under the peft
names (reads pass through, nothing is copied), so ``shardwise.initialize(weights=...)`` maps
them as it maps any model's, each rank reading only what it keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.hf import model_spec, open_weights
from shardwise.hf.source import ClosesOnExit

PEFT_PREFIX = "base_model.model."


def base_name(peft_name: str) -> str:
    """The plain model's name of a peft model's base tensor (``peft_name`` without the peft
    prefix and ``.base_layer``)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


class PeftNamedSource(ClosesOnExit):
    """The tensors of a weights source under the names of ``model``, a peft model: each of its
    state-dict names whose base name the source holds; read_box and the rest pass through."""

    def __init__(self, inner: Any, model: nn.Module) -> None:
        self.inner = inner
        held = set(inner.names())
        self.stored = {n: base_name(n) for n in model_spec(model).tensors if base_name(n) in held}

    def names(self) -> list[str]:
        return sorted(self.stored)

    def __contains__(self, name: object) -> bool:
        return name in self.stored

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.inner.shape(self.stored[name]))

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(self.stored[name])

    @property
    def origin(self) -> Path:
        return self.inner.origin

    @property
    def bytes_read(self) -> int:
        return int(self.inner.bytes_read)

    def read_box(
        self,
        name: str,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self.inner.read_box(self.stored[name], offsets, shape, dtype)

    def close(self) -> None:
        self.inner.close()


def open_base_weights(model_dir: Path, model: nn.Module) -> Any:
    """The directory's weights for ``model``: as stored for a plain model, under the peft names
    for a peft model (``PeftNamedSource``)."""
    source = open_weights(model_dir)
    if hasattr(model, "peft_config"):
        return PeftNamedSource(source, model)
    return source

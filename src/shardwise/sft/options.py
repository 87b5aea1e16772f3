"""What a ``shardwise finetune`` run adds to a training run's options (stored in
``config.json`` under ``finetune``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.sft.lora import LoraSpec

DEFAULT_SEQ_LEN = 512
"""Tokens per sequence unless ``--seq-len`` says otherwise (capped by the model's context)."""


@dataclass(kw_only=True)
class FinetuneOptions:
    """The fine-tuning knobs; each field documents its unit."""

    model_dir: str
    """The Hugging Face model directory (config, safetensors, tokenizer)."""
    eval_data: str | None = None
    """Validation records (same shapes as the training data), or None."""
    lora: str | None = None
    """``--lora`` text (``LoraSpec.parse``), or None for full fine-tuning."""
    packing: bool = False
    """Pack examples into full ``seq_len`` rows (block-diagonal attention)."""
    train_on_prompt: bool = False
    """Take the loss on prompts and user turns too."""
    skip_bad_lines: bool = False
    """Skip malformed records (counted) instead of stopping at the first."""
    merge: bool = False
    """With LoRA: also write the merged full model at the end."""

    def __post_init__(self) -> None:
        if self.lora is not None:
            LoraSpec.parse(self.lora)  # ValueError naming the bad entry
        if self.merge and self.lora is None:
            raise ValueError(
                "--merge merges LoRA adapters: it needs --lora (--full saves the model)"
            )
        if self.eval_data is not None and not Path(self.eval_data).is_file():
            raise ValueError(f"--eval-data {self.eval_data} does not exist")

    @property
    def lora_spec(self) -> LoraSpec | None:
        return None if self.lora is None else LoraSpec.parse(self.lora)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneOptions:
        return cls(**data)

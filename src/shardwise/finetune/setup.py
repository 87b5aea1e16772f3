"""A rank's fine-tuning model: the directory's model with its weights, LoRA or not, with the
mesh's parallelisms applied (tensor parallelism by the model type's plan). ZeRO over dp comes
after, in ``shardwise.initialize``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.finetune.lora import LoraSpec, apply_lora
from shardwise.finetune.model import (
    build_model,
    check_model_dir,
    decoder_layer_classes,
    load_base_weights,
)
from shardwise.mesh import Mesh
from shardwise.parallel import plans
from shardwise.parallel.parallelize import Parallelized, ParallelPlan, parallelize

TP_PLANS = {"llama": plans.llama.tp_plan}
"""Model types with a tensor-parallel plan (``--tp`` refuses the others)."""


@dataclass
class FinetuneModel:
    """The parallelized model and what the engine needs to know about it."""

    parallelized: Parallelized
    hf_config: Any
    lora: LoraSpec | None
    wrap_policy: list[str]
    """ZeRO-3 units: the decoder layer classes."""

    @property
    def module(self) -> torch.nn.Module:
        return self.parallelized.module

    @property
    def attn_implementation(self) -> str | None:
        return getattr(self.hf_config, "_attn_implementation", None)


def build_finetune_model(
    model_dir: Path, mesh: Mesh, *, lora: LoraSpec | None, seed: int = 0
) -> FinetuneModel:
    """Build the model of ``model_dir`` with its weights (``load_base_weights``), LoRA
    adapters on it (seeded with ``seed``, so every rank draws the same), and ``mesh``'s tensor
    parallelism. Communicates nothing (the engine broadcasts from the first rank later)."""
    config = check_model_dir(model_dir)
    model = build_model(config, seed)
    load_base_weights(model, model_dir)
    wrap = decoder_layer_classes(model)
    if lora is not None:
        if mesh.tp_size > 1:
            raise ValueError(
                "--lora with --tp is not supported yet: LoRA adapters on tp-split layers are "
                "refused; use --tp 1 with --lora, or --full with --tp"
            )
        torch.manual_seed(seed)
        model = apply_lora(model, lora)
    tensor = None
    if mesh.tp_size > 1:
        plan_of = TP_PLANS.get(config.model_type)
        if plan_of is None:
            raise ValueError(
                f"--tp {mesh.tp_size}: model type {config.model_type!r} has no tensor-parallel "
                f"plan (plans exist for {', '.join(TP_PLANS)}); use --tp 1"
            )
        tensor = plan_of()
    built = parallelize(model, mesh, ParallelPlan(tensor=tensor))
    return FinetuneModel(built, model.config, lora, wrap)

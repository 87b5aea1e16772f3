"""A rank's fine-tuning model: the directory's model built on the meta device (no rank holds
it whole), LoRA or not, with the mesh's parallelisms applied (tensor parallelism by the model
type's plan). ``shardwise.initialize(..., **fm.initialize_kwargs())`` then allocates only what
each rank keeps and streams those pieces from the model directory; ZeRO over dp comes there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise import hf
from shardwise.engine.materialize import deferred_init
from shardwise.finetune.base_weights import open_base_weights
from shardwise.finetune.lora import LoraSpec, adapter_init_fn, apply_lora
from shardwise.finetune.model import build_model, check_model_dir, decoder_layer_classes
from shardwise.mesh import Mesh
from shardwise.parallel import plans
from shardwise.parallel.parallelize import Parallelized, ParallelPlan, parallelize

TP_PLANS = {"llama": plans.llama.tp_plan}
"""Model types with a tensor-parallel plan (``--tp`` refuses the others)."""


@dataclass
class FinetuneModel:
    """The parallelized model (on the meta device) and what the engine needs to know about it."""

    parallelized: Parallelized
    hf_config: Any
    lora: LoraSpec | None
    wrap_policy: list[str]
    """ZeRO-3 units: the decoder layer classes."""
    model_dir: Path
    """Where the base weights come from (at the start, and again on every resume)."""
    init_fn: Callable[[torch.nn.Module], None] | None
    """Initializes the LoRA adapters (the model directory holds only the base)."""

    @property
    def module(self) -> torch.nn.Module:
        return self.parallelized.module

    @property
    def attn_implementation(self) -> str | None:
        return getattr(self.hf_config, "_attn_implementation", None)

    def initialize_kwargs(self) -> dict[str, Any]:
        """``shardwise.initialize``'s weight arguments: the model directory, streamed; lenient
        only for the adapters it cannot hold (the base names were checked strictly)."""
        weights = open_base_weights(self.model_dir, self.module)
        return {"weights": weights, "strict": self.lora is None, "init_fn": self.init_fn}


def lora_tp_refusal(model: torch.nn.Module, lora: LoraSpec) -> str:
    """The one line refusing LoRA under tensor parallelism, naming the first adapted layer."""
    first = next(
        (n for n, _ in model.named_modules() if any(n.endswith("." + t) for t in lora.targets)),
        ", ".join(lora.targets),
    )
    return (
        f"--lora with --tp is not supported yet: the adapted layer {first} is split over tp; "
        "use --tp 1 with --lora, or --full with --tp"
    )


def check_base_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Every tensor of ``model`` (a meta model is fine) is in ``model_dir`` with its shape, and
    nothing else is: ``WeightsError`` naming the differences. Reads the file headers only."""
    with hf.open_weights(model_dir) as source:
        hf.map_names(hf.model_spec(model), source, strict=True)


def build_finetune_model(
    model_dir: Path, mesh: Mesh, *, lora: LoraSpec | None, seed: int = 0
) -> FinetuneModel:
    """Build the model of ``model_dir`` on the meta device (its names checked against the
    directory's weights), LoRA adapters on it (initialized from ``seed`` by name, so every
    rank draws the same), and ``mesh``'s tensor parallelism. Communicates nothing (the
    weights are read in ``shardwise.initialize``)."""
    config = check_model_dir(model_dir)
    with deferred_init():
        model = build_model(config, seed)
    check_base_weights(model, model_dir)
    wrap = decoder_layer_classes(model)
    init_fn = None
    if lora is not None:
        if mesh.tp_size > 1:
            raise ValueError(lora_tp_refusal(model, lora))
        model = apply_lora(model, lora)
        init_fn = adapter_init_fn(model, seed)
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
    return FinetuneModel(built, model.config, lora, wrap, model_dir, init_fn)

"""A rank's fine-tuning model: the directory's model built on the meta device (no rank holds
it whole), LoRA or not, with the mesh's parallelisms applied (tensor parallelism by the model
type's plan, LoRA adapters on a split layer split to match it).
``shardwise.initialize(..., **fm.initialize_kwargs())`` then allocates only what each rank
keeps and streams those pieces from the model directory; ZeRO over dp comes there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise import hf
from shardwise.deferred import deferred_init
from shardwise.mesh import Mesh
from shardwise.parallel import plans
from shardwise.parallel.parallelize import Parallelized, ParallelPlan, parallelize
from shardwise.parallel.tensor.adapters import style_refusal
from shardwise.parallel.tensor.plan import resolve
from shardwise.sft.base_weights import PEFT_PREFIX, open_base_weights
from shardwise.sft.lora import LoraSpec, adapter_init_fn, apply_lora
from shardwise.sft.model import build_model, check_model_dir, decoder_layer_classes

TP_PLANS = {"llama": plans.llama.tp_plan, "gpt2": plans.gpt2.tp_plan}
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


def check_lora_under_tp(model: torch.nn.Module, lora: LoraSpec, plan: Mapping[str, str]) -> None:
    """Raise ``ValueError`` in one line naming the first layer that ``lora`` adapts but the
    tensor-parallel ``plan`` gives a style that cannot split adapters (a vocabulary
    embedding): ``model`` is the plain model (a meta one is fine), before peft."""
    for name, style in resolve(model, plan).items():
        if any(name == t or name.endswith("." + t) for t in lora.targets):
            refusal = style_refusal(name, style)
            if refusal is not None:
                raise ValueError(refusal)


def tp_plan_of(config: Any, tp_size: int) -> dict[str, str]:
    """The tensor-parallel plan of the model type of ``config``; ``ValueError`` in one line
    for a model type without one."""
    plan_of = TP_PLANS.get(config.model_type)
    if plan_of is None:
        raise ValueError(
            f"--tp {tp_size}: model type {config.model_type!r} has no tensor-parallel "
            f"plan (plans exist for {', '.join(TP_PLANS)}); use --tp 1"
        )
    return plan_of()


def under_peft(plan: Mapping[str, str]) -> dict[str, str]:
    """``plan`` (naming the plain model's modules) for the model peft wraps: nested under
    peft's prefix."""
    return {PEFT_PREFIX + k: v for k, v in plan.items()}


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
    tensor = tp_plan_of(config, mesh.tp_size) if mesh.tp_size > 1 else None
    if lora is not None:
        if tensor is not None:
            check_lora_under_tp(model, lora, tensor)
            tensor = under_peft(tensor)
        model = apply_lora(model, lora)
    built = parallelize(model, mesh, ParallelPlan(tensor=tensor))
    init_fn = None if lora is None else adapter_init_fn(built.module, seed, built.placements)
    return FinetuneModel(built, model.config, lora, wrap, model_dir, init_fn)

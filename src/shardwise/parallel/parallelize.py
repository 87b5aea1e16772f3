"""``shardwise.parallelize``: every parallelism that changes the model, applied from outside in
one order: pipeline split, tensor (and sequence) parallelism, recompute. ZeRO over the
data-parallel axis comes after, in ``shardwise.initialize``, which takes the result.

    mesh = shardwise.Mesh(pp=2, tp=2)
    plan = shardwise.parallel.plans.gpt.plan(cfg, mesh)
    parallelized = shardwise.parallelize(GPT(cfg), mesh, plan)
    engine = shardwise.initialize(parallelized, torch.optim.AdamW, config)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.deferred import init as materialize
from shardwise.mesh import Mesh
from shardwise.parallel.context import ContextParallel, apply_context_parallel
from shardwise.parallel.pipeline.stage import Entry, PipelineModule, Tied
from shardwise.parallel.placement import Placement
from shardwise.parallel.tensor.parallelize import TensorParallel, refuse_unmatched_on_every_stage
from shardwise.parallel.tensor.parallelize import parallelize as tensor_parallelize
from shardwise.recompute import apply_activation_checkpointing

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PipelineSplit:
    """How to cut a model into pipeline stages.

    ``layers``: the model as a flat list of pipeline entries (modules, ``LayerSpec``,
    ``LayerFn``, ``Tied``); ``loss_fn``: the last stage's loss on its output and the targets;
    ``partition``: ``"parameters"`` (balance parameter counts), ``"uniform"`` or explicit
    bounds (see ``PipelineModule``); ``virtual_stages``: stages per pp rank (interleaved
    schedules), stated here once."""

    layers: Callable[[nn.Module], Sequence[Entry]]
    loss_fn: Loss
    partition: Any = "parameters"
    virtual_stages: int = 1


@dataclass(frozen=True)
class ContextPlan:
    """Context parallelism over the mesh's cp axis: ``modules`` maps module-name patterns to
    styles (``shardwise.parallel.context.STYLES``: the attention to make exact over cp, the
    positions to make global); ``method``: ``"ring"`` or ``"all_to_all"``."""

    modules: Mapping[str, str]
    method: str = "ring"


@dataclass(frozen=True)
class ParallelPlan:
    """What ``parallelize`` applies, in this order.

    ``pipeline``: the split into stages over the mesh's pp axis (None: no pipeline);
    ``tensor``: a tensor-parallel plan ``{module-name pattern: style}`` over the tp axis, under
    the names of the model after the split (see ``shardwise.parallel.tensor.plan.STYLES``);
    ``sequence_parallel``: run its ``sequence`` modules on 1/tp of the sequence;
    ``context``: context parallelism over the cp axis (needed when the mesh has cp > 1);
    ``recompute``: module class names or name patterns whose activations are recomputed in
    backward (``shardwise.recompute.apply_activation_checkpointing``)."""

    tensor: Mapping[str, str] | None = None
    sequence_parallel: bool = False
    pipeline: PipelineSplit | None = None
    recompute: tuple[str, ...] = ()
    context: ContextPlan | None = None


@dataclass(frozen=True, eq=False)
class Parallelized:
    """A model with its parallelisms applied, and where each of its parameters lives.

    ``module``: the model (or this pp rank's ``PipelineModule``), tp-split;
    ``placements``: one ``Placement`` per parameter name of ``module`` (the tp axis; the
    engine adds the data-parallel and pipeline axes); ``tensor``: the tensor-parallel record
    (full state dicts, the tp dropout stream), or None; ``names``: a pipeline's parameter
    names -> the unsplit model's (``layers.3.attn.q_proj.weight`` -> ``blocks.1.attn...``),
    empty without a pipeline; ``context``: the cp record (``split`` the batch with it, take the
    loss over every cp rank's tokens with its ``loss``), or None."""

    module: nn.Module
    mesh: Mesh
    placements: Mapping[str, Placement]
    tensor: TensorParallel | None = None
    names: Mapping[str, str] = field(default_factory=dict)
    context: ContextParallel | None = None

    @property
    def pipeline(self) -> PipelineModule | None:
        return self.module if isinstance(self.module, PipelineModule) else None


def parallelize(
    model: nn.Module, mesh: Mesh, plan: ParallelPlan, *, keep_meta: bool = False
) -> Parallelized:
    """Apply ``plan`` to ``model`` over ``mesh``, in order: pipeline split (this pp rank keeps
    its stages), tensor and sequence parallelism, context parallelism, recompute. Pass the
    result to ``shardwise.initialize``.

    A model built on the meta device (``shardwise.deferred_init``) with a pipeline split: each
    pp rank makes only its own stages real, initialized as the eager model under the same
    random state (``PipelineModule``'s ``materialize``), so no rank allocates another stage's
    weights. ``keep_meta``: the stages stay on the meta device instead, for
    ``initialize(..., weights=...)`` to stream into (each rank then holds only its ZeRO
    shards); without weights the engine would initialize them module by module, not as the
    eager model. Without a pipeline the model stays on the meta device for ``initialize``.

    Raises ``ValueError``/``TypeError`` naming the module or pattern for a plan that does not
    fit the model or the mesh (see ``shardwise.parallel.tensor.parallelize``).
    Communicates: with a pipeline, the tied modules' groups and one broadcast per tied tensor
    (``PipelineModule``), and one all_gather_object over pp of the tensor plan's unmatched
    patterns, and one of the context plan's.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a shardwise Mesh, got {type(mesh).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a shardwise.ParallelPlan, got {type(plan).__name__}")
    module, names = model, {}
    if plan.pipeline is not None:
        split = plan.pipeline
        compute_meta_buffers(model)
        entries = list(split.layers(model))
        names = pipeline_names(model, entries)
        module = PipelineModule(
            entries,
            split.loss_fn,
            mesh,
            split.partition,
            virtual_stages=split.virtual_stages,
            plain_names=pipeline_names(model, entries, buffers=True),
            materialize=None if keep_meta or not _on_meta(model) else _stage_maker(model),
        )
    elif mesh.pp_size > 1:
        raise ValueError(
            f"the mesh has pp={mesh.pp_size} but the plan has no pipeline split: give "
            "ParallelPlan(pipeline=PipelineSplit(...)) or a mesh with pp=1"
        )
    tensor = None
    if plan.tensor is not None:
        tensor = tensor_parallelize(module, mesh, plan.tensor, plan.sequence_parallel)
    elif plan.sequence_parallel:
        raise ValueError("sequence_parallel needs a tensor-parallel plan (ParallelPlan(tensor=))")
    context = _context(module, mesh, plan)
    if plan.recompute:
        apply_activation_checkpointing(module, list(plan.recompute))
    placements = tensor.placements if tensor is not None else {}
    return Parallelized(module, mesh, placements, tensor, names, context)


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _stage_maker(model: nn.Module) -> Callable[[nn.Module], None]:
    """What makes a stage of meta-built ``model`` real: its modules' parameters get the
    values ``model``'s eager build gives them (``materialize.materialize_kept``), on the
    default device, where that build would have put them."""
    device = torch.get_default_device()

    def make(stage: nn.Module) -> None:
        materialize.materialize_kept(model, stage, None if device.type == "meta" else device)

    return make


def compute_meta_buffers(model: nn.Module) -> None:
    """Give a model built on the meta device real buffers (rotary tables, masks) by its own
    initialization, before a pipeline split: a stage is not the model, so the model's
    initialization (a Hugging Face model's ``_init_weights``) no longer reaches them after it;
    buffers are small, and parameters stay on the meta device."""
    if any(b.is_meta for b in model.buffers()):
        init = materialize.init_plan(model, None)
        materialize.materialize_buffers(model, init, materialize.target_device())


def _context(module: nn.Module, mesh: Mesh, plan: ParallelPlan) -> ContextParallel | None:
    """The plan's context parallelism applied to ``module`` (cp holds no parameter shards:
    nothing to place)."""
    if plan.context is None:
        if mesh.cp_size > 1:
            raise ValueError(
                f"the mesh has cp={mesh.cp_size} but the plan has no context parallelism: give "
                "ParallelPlan(context=ContextPlan(...)) or a mesh with cp=1"
            )
        return None
    if plan.pipeline is None:
        return apply_context_parallel(module, mesh, plan.context.modules, plan.context.method)
    unmatched: list[str] = []  # a stage holds some layers: a pattern must match on some stage
    cp = apply_context_parallel(module, mesh, plan.context.modules, plan.context.method, unmatched)
    refuse_unmatched_on_every_stage(module, mesh, plan.context.modules, unmatched)
    return cp


def pipeline_names(
    model: nn.Module, entries: Sequence[Entry], buffers: bool = False
) -> dict[str, str]:
    """``PipelineModule`` parameter names of ``entries`` (``layers.{i}.*`` by index,
    ``tied.{key}.*``) -> ``model``'s own names, for entries made of ``model``'s modules;
    ``buffers``: its buffers' names too."""
    own = {id(p): name for name, p in model.named_parameters()}
    if buffers:
        own.update({id(b): name for name, b in model.named_buffers()})
    out: dict[str, str] = {}
    for i, entry in enumerate(entries):
        prefix, module = (
            (f"tied.{entry.key}", entry.source)
            if isinstance(entry, Tied)
            else (f"layers.{i}", entry)
        )
        if not isinstance(module, nn.Module):
            continue  # built from a spec on its stage: not one of the model's modules
        tensors = [*module.named_parameters(), *(module.named_buffers() if buffers else ())]
        for n, p in tensors:
            if id(p) in own:
                out[f"{prefix}.{n}"] = own[id(p)]
    return out

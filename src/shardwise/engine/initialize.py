"""``shardwise.initialize``: the engine for a model (``Engine``) or for a pipeline-parallel
``PipelineModule`` (``PipelineEngine``), after the parallelisms that change the model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from shardwise import comm
from shardwise.comm.groups import Group
from shardwise.config import Config
from shardwise.deferred import InitFn
from shardwise.engine.core import Engine, SchedulerFactory
from shardwise.engine.materialize import fill_engine
from shardwise.engine.pipeline import PipelineEngine, check_pipeline_config
from shardwise.engine.pretrained import Source, load_pretrained
from shardwise.mesh import Mesh
from shardwise.parallel.parallelize import Parallelized
from shardwise.parallel.pipeline.stage import PipelineModule
from shardwise.parallel.placement import Placement
from shardwise.recompute import apply_activation_checkpointing
from shardwise.zero import optimizer as zero_opt

__all__ = ["initialize"]


def initialize(
    model: nn.Module | Parallelized,
    optimizer: zero_opt.OptimizerLike,
    config: Config | dict[str, Any] | None = None,
    *,
    group: Group | Mesh | None = None,
    lr_scheduler: SchedulerFactory | None = None,
    placements: Mapping[str, Placement] | None = None,
    weights: Path | str | Source | None = None,
    init_fn: InitFn | None = None,
    strict: bool = True,
) -> Engine:
    """Wrap ``model`` for ZeRO training over ``group`` (default: the world; a Mesh: its dp axis,
    the norm spanning its other axes too; a ``Mesh(dp_replicate=, dp_shard=)``: sharded over
    each dp_shard group and replicated across dp_replicate, hierarchical sharding).

    Parallelisms apply from outside the model in one order: pipeline split, tensor parallel
    and recompute (``shardwise.parallelize``, whose result this takes; or
    ``config.activation_checkpointing``, applied here), ZeRO (the Engine).

    Args:
        model: what ``shardwise.parallelize`` returned (its module, mesh and placements), or a
            model, on one device, identical in structure on every rank of the dp group
            (checked; weights are taken from the group's first rank). A model is initialized
            once.
        optimizer: a torch optimizer over ``model.parameters()`` (its class, hyperparameters
            and parameter groups are kept) or a callable ``params -> optimizer``.
        config: a ``Config`` or a dict of its keys.
        group: a ``Group`` (data parallel over it) or a ``Mesh`` (required for a
            ``shardwise.parallel.pipeline.PipelineModule``, which returns a ``PipelineEngine`` with
            ``train_batch`` / ``eval_batch``; ZeRO 0-3, fp32, bf16 or fp16).
        lr_scheduler: a callable ``optimizer -> scheduler``, stepped with the optimizer.
        placements: for a model split by hand or by ``shardwise.parallel.tensor.parallelize``:
            each parameter name's ``Placement`` (``tp.placements``); a model holding
            tensor-parallel layers without them is refused.

        weights: start from these weights (a Hugging Face model directory, a ``.safetensors``
            file or a shardwise checkpoint), each rank reading only what it keeps (see
            ``shardwise.engine.pretrained``); ``strict``: raise naming any missing, unexpected or
            mismatched tensor (False: log them; missing ones keep, or get, their
            initialization).
        init_fn: for a model built on the meta device (``shardwise.deferred_init``) without
            weights, or for what weights lack: ``init_fn(module)`` initializes each module's
            own parameters (default: the model's ``init_module`` / Hugging Face
            ``_init_weights`` / each module's ``reset_parameters``); see
            ``shardwise.deferred``.

    A model on the meta device is accepted at every stage and layout: each rank allocates only
    what it keeps (at ZeRO-3 its shards) and fills it from ``weights`` or module by module. A
    load or initialization that fails on one rank raises on every rank.

    Communicates: one all_gather of 8 bytes per rank (the structure check), broadcasts of every
    parameter and buffer from the group's first rank (a meta model: of the buffers only); with
    ``weights`` or a meta model, one all_gather_object of the load's outcome over every rank.
    """
    if isinstance(model, Parallelized):
        if group is not None and group is not model.mesh:
            raise ValueError("a parallelized model trains on its own mesh: leave group out")
        if placements is not None:
            raise ValueError("a parallelized model brings its placements: leave placements out")
        group, placements, model = model.mesh, model.placements, model.module
    if group is None:  # the public entry point: None is the current world
        group = comm.resolve(None)
    if config is None:
        config = Config()
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a shardwise.Config or a dict, got {type(config).__name__}")
    if isinstance(model, PipelineModule):
        check_pipeline_config(model, config, group)  # before anything changes the model
    if config.activation_checkpointing:
        apply_activation_checkpointing(model, config.activation_checkpointing)
    engine: Engine
    if isinstance(model, PipelineModule):
        assert isinstance(group, Mesh)
        engine = PipelineEngine(model, optimizer, config, group, lr_scheduler, placements, init_fn)
    else:
        engine = Engine(model, optimizer, config, group, lr_scheduler, placements, init_fn)
    if engine.deferred:
        fill_engine(engine, weights, init_fn, strict)
    elif weights is not None:
        load_pretrained(engine, weights, strict=strict)
    return engine

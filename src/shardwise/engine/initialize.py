"""``shardwise.initialize``: the engine for a model (``Engine``) or for a pipeline-parallel
``PipelineModule`` (``PipelineEngine``), after the parallelisms that change the model."""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.comm.groups import Group
from shardwise.config import Config
from shardwise.engine.core import Engine, SchedulerFactory
from shardwise.mesh import Mesh
from shardwise.parallel.pipeline.engine import PipelineEngine, check_pipeline_config
from shardwise.parallel.pipeline.stage import PipelineModule
from shardwise.recompute import apply_activation_checkpointing
from shardwise.zero import optimizer as zero_opt

__all__ = ["initialize"]


def initialize(
    model: nn.Module,
    optimizer: zero_opt.OptimizerLike,
    config: Config | dict[str, Any] | None = None,
    *,
    group: Group | Mesh | None = None,
    lr_scheduler: SchedulerFactory | None = None,
) -> Engine:
    """Wrap ``model`` for ZeRO training over ``group`` (default: the world; a Mesh: its dp axis,
    the norm spanning its other axes too; a ``Mesh(dp_replicate=, dp_shard=)``: sharded over
    each dp_shard group and replicated across dp_replicate, hierarchical sharding).

    Parallelisms apply from outside the model in one order: pipeline split, tensor parallel
    (both done by the caller before this, marking split parameters with
    ``shardwise.parallel.placement.mark_sharded``), recompute (``config.activation_checkpointing``,
    applied here by ``shardwise.recompute.apply_activation_checkpointing``), ZeRO (the Engine).

    Args:
        model: the model, on one device, identical in structure on every rank of the dp group
            (checked; weights are taken from the group's first rank). A model is initialized
            once.
        optimizer: a torch optimizer over ``model.parameters()`` (its class, hyperparameters
            and parameter groups are kept) or a callable ``params -> optimizer``.
        config: a ``Config`` or a dict of its keys.
        group: a ``Group`` (data parallel over it) or a ``Mesh`` (required for a
            ``shardwise.parallel.pipeline.PipelineModule``, which returns a ``PipelineEngine`` with
            ``train_batch`` / ``eval_batch``; ZeRO 0-3, fp32, bf16 or fp16).
        lr_scheduler: a callable ``optimizer -> scheduler``, stepped with the optimizer.

    Communicates: one all_gather of 8 bytes per rank (the structure check), broadcasts of every
    parameter and buffer from the group's first rank.
    """
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
    if isinstance(model, PipelineModule):
        assert isinstance(group, Mesh)
        return PipelineEngine(model, optimizer, config, group, lr_scheduler)
    return Engine(model, optimizer, config, group=group, lr_scheduler=lr_scheduler)

"""Parallelism applied to a model from outside, in one order: pipeline split (``pipeline``),
tensor and sequence parallelism (``tensor``), context parallelism (``context``), recompute;
``parallelize`` applies a ``ParallelPlan`` and returns the model with one ``Placement`` per
parameter (``placement``: ``Shard``, ``Replicate`` or ``StageOwned`` per mesh axis), which
``shardwise.initialize`` takes.
Ready-made plans: ``plans.gpt``, ``plans.llama``."""

from shardwise.parallel import (
    context,
    pipeline,
    placement,
    plans,
    tensor,
)
from shardwise.parallel.parallelize import (
    ContextPlan,
    Parallelized,
    ParallelPlan,
    PipelineSplit,
    parallelize,
    pipeline_names,
)
from shardwise.parallel.placement import Placement, Replicate, Shard, StageOwned

__all__ = [
    "ContextPlan",
    "ParallelPlan",
    "Parallelized",
    "PipelineSplit",
    "Placement",
    "Replicate",
    "Shard",
    "StageOwned",
    "context",
    "parallelize",
    "pipeline",
    "pipeline_names",
    "placement",
    "plans",
    "tensor",
]

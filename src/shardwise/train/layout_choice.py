"""Which layouts ``shardwise train`` can run, and the best of them by the cost model.

A cost-model ``Layout`` becomes the train command's settings (``train_settings``: the flags'
names and values) and the engine config values no flag sets (``engine_values``); a candidate
is kept only if the flags the user gave (pins) agree with it and the run it describes passes the
launcher's own checks (layout, pipeline, memory) and ``Config``'s validation. ``choose`` ranks
what is left on a measured ``Hardware``; ``shardwise train --auto`` calls it for the built-in
GPT (``gpt_target``), ``shardwise finetune --auto`` with its Hugging Face model's ``Target``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardwise.comm.algorithms import ALGORITHMS
from shardwise.costmodel.hardware import Hardware
from shardwise.costmodel.layout_search import (
    Layout,
    SearchResult,
    SearchSpace,
    StageLayers,
    search,
)
from shardwise.costmodel.shapes import ModelShape, gpt_shape
from shardwise.models.gpt import GPTConfig
from shardwise.parallel.pipeline.partition import partition_layers
from shardwise.train.options import RunConfig

SCHEDULE_NAMES = {"1f1b": "1f1b", "interleaved": "interleaved_1f1b", "gpipe": "gpipe",
                  "zb-h1": "zb_h1"}  # fmt: skip
"""Cost-model schedule -> the engine's ``pipeline_schedule``."""

TRAIN_RECOMPUTE = ("none", "full")
"""Recomputation the train command runs: none, or every block (--activation-checkpointing)."""

PINNABLE = ("tp", "pp", "cp", "cp_method", "dp_replicate", "zero", "micro_batch", "grad_accum",
            "schedule", "microbatches", "activation_checkpointing",
            "sequence_parallel")  # fmt: skip
"""Train flags that pin a dimension of the search when given with ``--auto``."""


@dataclass(frozen=True)
class Target:
    """What a command trains, as the search sees it: the model's ``shape``, how a pipeline
    splits its layers (``stages``; None: evenly), the module classes activation checkpointing
    wraps (``blocks``), the mesh axes the command cannot split (``fixed_axes``) and whether it
    runs sequence parallelism."""

    shape: ModelShape
    stages: StageLayers | None = None
    blocks: tuple[str, ...] = ("Block",)
    fixed_axes: tuple[str, ...] = ()
    sequence_parallel: bool = True


def gpt_target(base: RunConfig) -> Target:
    """The built-in GPT of ``shardwise train``: every axis, its parameter-balanced pipeline."""
    return Target(gpt_shape(base.train.model, base.model), gpt_stage_layers(base.model))


def train_space(
    precision: str, offload: bool, keep: Callable[[Layout], bool], target: Target | None = None
) -> SearchSpace:
    """The dimensions the command can run: every mesh (less ``target.fixed_axes``), ZeRO stage,
    schedule (two virtual stages when interleaved), micro-batch and accumulation, every
    all-reduce algorithm of the comm layer; offload only where the device is not the host
    (``offload``)."""
    algorithms = tuple(a for a in ALGORITHMS if a != "auto")  # auto picks among these itself
    space = SearchSpace(
        recompute=TRAIN_RECOMPUTE,
        allreduce_algorithms=algorithms,
        offload=(False, True) if offload else (False,),
        precision=precision,
        keep=keep,
    )
    if target is not None:
        sp = (False, True) if target.sequence_parallel else (False,)
        space = dataclasses.replace(space, fixed_axes=target.fixed_axes, sequence_parallel=sp)
    return space


def gpt_stage_layers(cfg: GPTConfig) -> Callable[[int, int], tuple[int, ...]]:
    """(pp, virtual stages) -> the GPT's transformer blocks on each pp rank, as the train
    command's ``PipelineModule`` splits ``plans.gpt.pipeline_layers()`` (by parameters; stage ``s``
    on rank ``s % pp``); ``ValueError`` when the layers cannot fill the stages."""
    one, two = (dataclasses.replace(cfg, n_layer=n).param_count() for n in (1, 2))
    block = two - one
    d = cfg.d_model
    counts = [cfg.vocab_size * d, cfg.seq_len * d, *[block] * cfg.n_layer, 2 * d,
              cfg.vocab_size * d]  # fmt: skip
    blocks = range(2, 2 + cfg.n_layer)

    def split(pp: int, v: int) -> tuple[int, ...]:
        bounds = partition_layers(counts, pp * v, "parameters")
        per_rank = [0] * pp
        for s, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            per_rank[s % pp] += sum(lo <= i < hi for i in blocks)
        return tuple(per_rank)

    return split


def train_settings(layout: Layout) -> dict[str, Any]:
    """The train flags (``PINNABLE``) that run ``layout``: under a pipeline each step's
    sequences go through one ``train_batch`` split into the plan's micro-batches."""
    plan = layout.plan
    out: dict[str, Any] = {
        "tp": plan.tp,
        "pp": plan.pp,
        "cp": plan.cp,
        "cp_method": plan.cp_method,
        "dp_replicate": layout.dp_replicate,
        "zero": plan.zero_stage,
        "activation_checkpointing": plan.recompute == "full",
        "sequence_parallel": plan.sequence_parallel,
    }
    if plan.pp > 1:
        m = plan.micro_batches
        out.update(micro_batch=plan.micro_batch * m, grad_accum=1, microbatches=m,
                   schedule=SCHEDULE_NAMES[plan.schedule])  # fmt: skip
    else:
        out.update(micro_batch=plan.micro_batch, grad_accum=plan.micro_batches, microbatches=1,
                   schedule="1f1b")  # fmt: skip
    return out


def engine_values(layout: Layout) -> dict[str, Any]:
    """Engine config values of ``layout`` that no train flag sets."""
    return {
        "allreduce_algorithm": layout.allreduce_algorithm,
        "offload_optimizer": layout.offload_optimizer,
        "pipeline_virtual_stages": layout.plan.virtual_stages,
    }


def run_config(base: RunConfig, layout: Layout, blocks: tuple[str, ...] = ("Block",)) -> RunConfig:
    """``base`` (model, data, precision, world) with ``layout``'s parallelism and batch shape,
    recomputing the ``blocks`` classes under full recomputation (``ValueError`` if ``Config``
    refuses the combination)."""
    s = train_settings(layout)
    engine = base.engine.replace(
        zero_stage=s["zero"],
        micro_batch_size=s["micro_batch"],
        gradient_accumulation_steps=s["grad_accum"],
        pipeline_schedule=s["schedule"],
        pipeline_microbatches=s["microbatches"],
        activation_checkpointing=list(blocks) if s["activation_checkpointing"] else None,
        **engine_values(layout),
    )
    train = dataclasses.replace(
        base.train,
        tp=s["tp"],
        pp=s["pp"],
        cp=s["cp"],
        cp_method=s["cp_method"],
        dp_replicate=s["dp_replicate"],
        sequence_parallel=s["sequence_parallel"],
    )
    return dataclasses.replace(base, train=train, engine=engine)  # a fine-tuning run stays one


def pinned(layout: Layout, pins: Mapping[str, Any]) -> bool:
    """Whether ``layout`` agrees with every pinned flag."""
    settings = train_settings(layout)
    return all(settings[k] == v for k, v in pins.items())


Check = Callable[[RunConfig], None]


def keeper(
    base: RunConfig,
    pins: Mapping[str, Any],
    checks: list[Check],
    blocks: tuple[str, ...] = ("Block",),
) -> Callable[[Layout], bool]:
    """The search's ``keep``: the pins agree, ``Config`` accepts the run and every check
    (raising ``ValueError`` to refuse) passes."""
    unknown = set(pins) - set(PINNABLE)
    if unknown:
        raise ValueError(f"cannot pin {sorted(unknown)}; pinnable: {', '.join(PINNABLE)}")

    def keep(layout: Layout) -> bool:
        if not pinned(layout, pins):
            return False
        try:
            run = run_config(base, layout, blocks)
            for check in checks:
                check(run)
        except ValueError:
            return False
        return True

    return keep


@dataclass(frozen=True)
class Choice:
    """The search's outcome for a run: ``result`` ranked, on ``hardware``."""

    shape: ModelShape
    result: SearchResult
    hardware: Hardware
    global_batch: int


def choose(
    base: RunConfig,
    hw: Hardware,
    global_batch: int,
    pins: Mapping[str, Any],
    checks: list[Check],
    host_bw_bytes_per_s: float = 0.0,
    target: Target | None = None,
) -> Choice:
    """Every layout of ``target`` (default: ``base``'s built-in GPT) on ``base``'s ranks for
    ``global_batch`` sequences per step, ranked on ``hw`` (see the module docstring)."""
    target = target or gpt_target(base)
    keep = keeper(base, pins, checks, target.blocks)
    space = train_space(base.engine.precision, host_bw_bytes_per_s > 0, keep, target)
    space = dataclasses.replace(space, host_bw_bytes_per_s=host_bw_bytes_per_s)
    result = search(target.shape, base.world_size, hw, global_batch, space, target.stages)
    return Choice(target.shape, result, hw, global_batch)

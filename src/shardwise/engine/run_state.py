"""The small, non-tensor part of an engine checkpoint: steps, settings, RNG states.

``trainer_state`` is the JSON record stored in the manifest: global and micro step, resolved
config, world size, dp size, ZeRO stage, precision, loss scaler, learning-rate scheduler,
optimizer class with each group's hyperparameters and the scalar optimizer states per parameter
(Adam's ``step``), data sampler position, tied-parameter aliases, the caller's ``extra`` and
format notes. ``rank_state`` is what each rank stores for itself (tensors and JSON, never a
pickle): its RNG states.

Scheduler states are made JSON with one extension: a dict with non-string keys (MultiStepLR's
milestones) is stored as ``{"__items__": [[key, value], ...]}``. Nothing here communicates.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from shardwise.checkpoint.reader import CheckpointReader
from shardwise.comm.groups import Group
from shardwise.config import Config
from shardwise.engine.placements import EnginePlacements
from shardwise.precision import DynamicLossScaler
from shardwise.seeding import seed_all
from shardwise.zero.checkpoint_entries import ModelNames, ScalarStates
from shardwise.zero.flat_param import FlatParam
from shardwise.zero.stage import ZeroStage

log = logging.getLogger("shardwise.checkpoint")


@dataclass
class Steps:
    """An engine's step counters; the engine and its checkpoint state share one."""

    global_step: int = 0
    micro_step: int = 0
    skipped_steps: int = 0


@dataclass(frozen=True)
class CheckpointState:
    """Everything an engine checkpoint saves and loads, as the engine built it
    (``Engine.checkpoint_state()``); the checkpoint code reads nothing else of the engine.

    Args:
        config: the engine's resolved config (stored, and its checkpoint settings).
        save_group: the ranks that save and load together: the engine's whole mesh
            (pp x dp x tp), or its data-parallel group; a sub-world's engine saves on its own.
        shard_group: the group ZeRO shards the flat buffers over by default (a flat buffer's
            own ``group`` says where its file boxes come from).
        dp_size: every data-parallel rank (shards and replicas), recorded.
        pp_group: the pipeline group whose stages merge their names (None without pp).
        tp_size: tensor-parallel degree, recorded.
        stage: the ZeRO stage.
        module: the engine's model (its names and buffers).
        flats: the flat buffers (masters and optimizer pieces).
        placements: where every parameter lives (checkpoint boxes).
        optimizer: the optimizer over this rank's shards.
        lr_scheduler: its scheduler, or None.
        scaler: the loss scaler.
        writes_buffer: whether this rank writes the buffer of a state-dict key.
        steps: the step counters, shared with the engine (a load sets them).
    """

    config: Config
    save_group: Group
    shard_group: Group
    dp_size: int
    pp_group: Group | None
    tp_size: int
    stage: ZeroStage
    module: nn.Module
    flats: tuple[FlatParam, ...]
    placements: EnginePlacements
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    scaler: DynamicLossScaler
    writes_buffer: Callable[[str], bool]
    steps: Steps

    @property
    def me(self) -> int:
        """This process's rank in its world (for log lines)."""
        return self.save_group.ranks[self.save_group.rank]

    def zero_group(self, param: torch.Tensor) -> Group:
        """The group whose flat ranges hold ``param``: its flat buffer's, or ``shard_group``
        for a parameter outside the flat buffers (frozen at stages 0-2, saved as an even
        split over it)."""
        return self._flat_groups.get(id(param), self.shard_group)

    @cached_property
    def _flat_groups(self) -> dict[int, Group]:
        return {id(p): f.group for f in self.flats for p in f.params}


class Stateful(Protocol):
    """A data sampler (or anything) whose position a checkpoint saves and restores."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


ENGINE_FORMAT = {
    "name": "shardwise-engine",
    "version": 2,
    "notes": "model/<param>: fp32 master values; optim/<param>/<key>: element-wise optimizer "
    "states; buffer/<name>: persistent buffers (floating ones fp32); "
    "optimizer.scalar_states: per-parameter scalar states; aliases: state-dict keys "
    "that name an already stored tensor (tied weights); rank states: RNG states as "
    "tensors and JSON",
}
READABLE_ENGINE_VERSIONS = (1, 2)
"""1: as 2, with rank states pickled (not loaded: RNG states are re-seeded instead)."""
_ITEMS_TAG = "__items__"  # a dict whose keys are not all strings, as [[key, value], ...]


# ---- JSON for scheduler and optimizer hyperparameters ----


def _to_json(value: Any, where: str) -> Any:
    """``value`` as JSON types (tensors of one element become numbers); ValueError naming
    ``where`` for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _to_json(v, f"{where}.{k}") for k, v in value.items()}
        return {
            _ITEMS_TAG: [
                [_to_json(k, where), _to_json(v, f"{where}[{k!r}]")] for k, v in value.items()
            ]
        }
    raise ValueError(
        f"{where} is a {type(value).__name__}, which a checkpoint's trainer state "
        f"(JSON) cannot hold"
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_ITEMS_TAG}:
            return {_from_json(k): _from_json(v) for k, v in value[_ITEMS_TAG]}
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _scheduler_state(scheduler: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """A saved scheduler state back from JSON, with the container types the scheduler uses
    now (a tuple stays a tuple, MultiStepLR's milestones a Counter)."""
    state = _from_json(saved)
    for key, value in state.items():
        now = getattr(scheduler, key, None)
        if isinstance(now, (Counter, tuple)) and isinstance(value, (dict, list)):
            state[key] = type(now)(value)
    return state


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's JSON-able settings (lr, betas...), without its parameters."""
    groups = []
    for g in optimizer.param_groups:
        kept = {}
        for k, v in g.items():
            if k == "params":
                continue
            try:
                kept[k] = _to_json(v, k)
            except ValueError:  # set by the constructor again on load
                log.debug("optimizer setting %r is not saved (not JSON)", k)
        groups.append(kept)
    return groups


def _restore_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this "
            f"one {len(optimizer.param_groups)}; build the optimizer with the same "
            f"groups"
        )
    for group, values in zip(optimizer.param_groups, saved):
        for k, v in values.items():
            now = group.get(k)
            if isinstance(now, torch.Tensor):
                now.fill_(v)
            elif isinstance(now, tuple):
                group[k] = tuple(v)
            else:
                group[k] = v


def trainer_state(
    engine: CheckpointState,
    names: ModelNames,
    scalars: ScalarStates,
    sampler: Stateful | None,
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON record of ``engine``'s run (see the module docstring); ``scalars`` are the
    merged scalar optimizer states of every parameter."""
    sched = engine.lr_scheduler
    return {
        "format": ENGINE_FORMAT,
        "global_step": engine.steps.global_step,
        "micro_step": engine.steps.micro_step,
        "skipped_steps": engine.steps.skipped_steps,
        "config": engine.config.to_dict(),
        "world_size": engine.save_group.size,
        "dp_size": engine.dp_size,
        "tp_size": engine.tp_size,
        "pp_size": 1 if engine.pp_group is None else engine.pp_group.size,
        "zero_stage": engine.stage.stage,
        "precision": engine.config.precision,
        "loss_scaler": {"enabled": engine.scaler.enabled, **engine.scaler.state_dict()},
        "lr_scheduler": None if sched is None else _to_json(sched.state_dict(), "lr_scheduler"),
        "optimizer": {
            "class": type(engine.optimizer).__name__,
            "param_groups": _hyperparameters(engine.optimizer),
            "scalar_states": scalars,
        },
        "sampler": None if sampler is None else sampler.state_dict(),
        "aliases": names.aliases,
        "extra": extra or {},
    }


def rank_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and (once initialized) CUDA."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def restore_trainer(
    engine: CheckpointState, state: dict[str, Any], sampler: Stateful | None
) -> None:
    """Steps, loss scaler (when both runs scale), optimizer hyperparameters, scheduler and
    ``sampler`` from a trainer state. A micro step that does not fall on an optimizer-step
    boundary of this run's accumulation is set to ``global_step * accumulation``."""
    accum = engine.config.gradient_accumulation_steps
    steps = engine.steps
    steps.global_step = int(state["global_step"])
    micro = int(state["micro_step"])
    steps.micro_step = micro if micro % accum == 0 else steps.global_step * accum
    steps.skipped_steps = int(state.get("skipped_steps", 0))
    scaler = state["loss_scaler"]
    if scaler["enabled"] and engine.scaler.enabled:
        engine.scaler.load_state_dict(scaler)
    _restore_hyperparameters(engine.optimizer, state["optimizer"]["param_groups"])
    sched = state["lr_scheduler"]
    if engine.lr_scheduler is not None and sched is not None:
        engine.lr_scheduler.load_state_dict(_scheduler_state(engine.lr_scheduler, sched))
    elif (engine.lr_scheduler is None) != (sched is None):
        log.warning(
            "rank %d: the checkpoint %s a learning-rate scheduler state, the engine %s "
            "a scheduler: not restored",
            engine.me,
            "has" if sched else "has no",
            "has no" if engine.lr_scheduler is None else "has",
        )
    if sampler is not None:
        if state.get("sampler") is None:
            raise ValueError("the checkpoint holds no sampler state; load without sampler=")
        sampler.load_state_dict(state["sampler"])


def restore_rng(engine: CheckpointState, reader: CheckpointReader) -> None:
    """At the saving world size, give this rank the RNG states its rank of the saving group
    saved;
    otherwise (or from a format-1 checkpoint, whose pickled states are never loaded) re-seed
    every rank with ``config.seed + global_step`` and say so."""
    version = reader.manifest.format_version
    group = engine.save_group
    if reader.world_size == group.size and version >= 2:
        rs = reader.rank_state(group.rank)
        random.setstate(rs["python"])
        np.random.set_state(rs["numpy"])
        torch.set_rng_state(rs["torch"])
        if (
            rs["cuda"] is not None
            and torch.cuda.is_available()
            and len(rs["cuda"]) == torch.cuda.device_count()
        ):
            torch.cuda.set_rng_state_all(rs["cuda"])
        return
    seed = engine.config.seed + engine.steps.global_step
    seed_all(seed)
    why = (
        f"checkpoint written by {reader.world_size} ranks, now {group.size}"
        if version >= 2
        else f"format_version {version} checkpoint (its RNG states are pickles, never loaded)"
    )
    log.log(
        logging.INFO if version >= 2 else logging.WARNING,
        "rank %d: %s: RNG states not restored; re-seeded with config.seed + global_step = %d",
        engine.me,
        why,
        seed,
    )

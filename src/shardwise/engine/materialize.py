"""The engine's side of deferred initialization (``shardwise.deferred``): its kept pieces of a
model built on the meta device filled from weights or by initializing module by module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.deferred.init import InitFn, InitPlan, fill_by_init, init_plan, materialize_buffers
from shardwise.deferred.peak import InitPeak
from shardwise.engine.targets import ParamTargets
from shardwise.zero.flat_param import make_real

__all__ = ["fill_engine", "outside_flats", "prepare"]


def fill_engine(
    engine: Any,
    weights: Any = None,
    init_fn: InitFn | None = None,
    strict: bool = True,
) -> None:
    """Give a deferred engine's kept pieces their values: from ``weights`` (a source for
    ``engine.pretrained.open_source``; in lenient mode, what it lacks is initialized), else by
    initializing module by module. Communicates: one all_gather_object over every rank
    (``pretrained.on_every_rank``), so a failure on one rank raises on all.

    Raises:
        ValueError: naming the parameters nothing filled; WeightsError: naming the file and
            tensor at fault; on every rank.
    """
    from shardwise.engine import pretrained  # the loader imports the engine's parts

    pretrained.on_every_rank(engine, lambda: _fill(engine, weights, init_fn, strict))


def _fill(engine: Any, weights: Any, init_fn: InitFn | None, strict: bool) -> None:
    from shardwise.engine import pretrained

    module = engine.module
    targets = ParamTargets(module, engine._where, engine.placements)
    peak: InitPeak = engine.init_peak
    plan = init_plan(module, init_fn)
    if weights is not None:
        with pretrained.open_source(weights) as source:
            pretrained.stream_into(module, targets, source, strict, peak)
        left = {i for i in targets.by_id if i not in targets.filled}
        if left:
            fill_by_init(module, targets, plan, engine.device, peak, only=left, eager=False)
    else:
        fill_by_init(module, targets, plan, engine.device, peak)
    unfilled = targets.unfilled()
    if unfilled:
        raise ValueError(
            f"parameters {unfilled[:5]} are still on the meta device after initialization "
            f"({len(unfilled)} in all): nothing loaded or initialized them; give weights= "
            f"holding them, or an init_fn (or a reset_parameters) that sets them"
        )


def prepare(model: nn.Module, plan: InitPlan, device: torch.device) -> None:
    """Before the flat buffers are built: every meta buffer made real and initialized."""
    materialize_buffers(model, plan, device)


def outside_flats(model: nn.Module, inside: set[int], device: torch.device) -> None:
    """Parameters outside flat buffers (frozen ones at stages 0-2) get real zeroed tensors,
    filled with the rest."""
    for p in model.parameters():
        if id(p) not in inside and p.is_meta:
            make_real(p, device)
            p.data = torch.zeros(p.shape, dtype=p.dtype, device=device)

"""Deferred initialization: a model built on the meta device becomes real one piece at a time.

``with shardwise.deferred_init(): model = Model(cfg)`` (the same as ``torch.device("meta")``,
nothing recorded globally) builds a model that holds no memory. ``shardwise.initialize``
accepts it: the engine allocates only what this rank keeps (at ZeRO-3 its shard of every flat
buffer, under tp its slice), then fills it from a checkpoint (``weights=``, see
``engine.pretrained``) or by initializing the model module by module: each module's own
parameters are made real on this rank (every rank draws from the same seed), initialized, the
pieces this rank keeps copied out, and freed before the next module. So no rank holds more than
its final state plus one module's parameters.

How a module is initialized, first that applies: the user's ``init_fn(module)``; the model's
``init_module(name, module)`` (the built-in GPT; its constructors' random draws are replayed
first, so the weights equal an eagerly built model's under the same seed, bitwise); a Hugging
Face model's ``_init_weights(module)`` (children before parents, as ``post_init``); else the
module's ``reset_parameters()``. A parameter nothing filled is an error naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.engine.memory import InitPeak
from shardwise.engine.targets import ParamTargets
from shardwise.zero.flat_param import make_real

InitFn = Callable[[nn.Module], None]
Hook = Callable[[str, nn.Module], None]

__all__ = ["InitFn", "deferred_init", "fill_engine", "target_device"]


@contextmanager
def deferred_init() -> Iterator[None]:
    """Build models inside on the meta device (no memory held; nothing recorded globally):
    ``shardwise.initialize`` then materializes only what each rank keeps."""
    with torch.device("meta"):
        yield


def target_device() -> torch.device:
    """Where a deferred model's pieces are made: the current CUDA device if any, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _has_direct(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None and b.is_meta for b in module._buffers.values()
    )


@contextmanager
def scratch(module: nn.Module, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """``module``'s own parameters swapped for real, uninitialized tensors on ``device`` inside
    the block (yielded by name), its original parameter objects back after; meta buffers are
    made real for good (they are small and every rank keeps them). The swap touches the
    module's parameter table only: the engine's parameter objects stay where the flat buffers
    put them, and an init function sees plain tensors."""
    original = dict(module._parameters)
    made: dict[str, torch.Tensor] = {}
    for key, p in original.items():
        if p is not None:
            # NaN until set: a parameter the initialization skips is caught, never trained
            fill = float("nan") if p.dtype.is_floating_point else 0
            real = nn.Parameter(torch.full(p.shape, fill, dtype=p.dtype, device=device))
            real.requires_grad_(p.requires_grad)
            module._parameters[key] = made[key] = real
    for key, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)
    try:
        yield made
    finally:
        module._parameters.update(original)


def _postorder(root: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, child in root.named_children():
        out += _postorder(child, f"{prefix}{name}.")
    out.append((prefix.rstrip("."), root))
    return out


@dataclass(frozen=True)
class InitPlan:
    """How and in which order the modules of a model are initialized."""

    hook: Hook
    order: list[tuple[str, nn.Module]]
    replay: bool  # run every reset_parameters first, as the constructors did, to draw alike
    only_reset: bool = False  # the hook is reset_parameters alone (buffers need one)


def init_plan(model: nn.Module, init_fn: InitFn | None) -> InitPlan:
    """The first applicable way to initialize ``model`` (see the module docstring)."""
    pre = list(model.named_modules())
    if init_fn is not None:
        return InitPlan(lambda name, m: init_fn(m), pre, replay=False)
    own = getattr(model, "init_module", None)
    if callable(own):
        return InitPlan(own, pre, replay=True)
    hf = getattr(model, "_init_weights", None)
    if callable(hf) and hasattr(model, "config"):
        return InitPlan(lambda name, m: hf(m), _postorder(model), replay=False)

    def reset(name: str, m: nn.Module) -> None:
        fn = getattr(m, "reset_parameters", None)
        if callable(fn):
            fn()

    return InitPlan(reset, pre, replay=False, only_reset=True)


def materialize_buffers(model: nn.Module, plan: InitPlan, device: torch.device) -> None:
    """Make every meta buffer real and give it its initial value (rotary tables, masks): the
    owning module is initialized on scratch parameters, which are dropped. Raises ValueError
    naming a meta buffer of a module that nothing initializes."""
    for name, m in plan.order:
        metas = [k for k, b in m._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        if plan.only_reset and not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(
                f"buffer {(name + '.' if name else '') + metas[0]!r} is on the meta device and "
                f"nothing computes it: give initialize an init_fn that sets it, or register it "
                f"after building the model on a real device"
            )
        with scratch(m, device), torch.no_grad():
            plan.hook(name, m)


def _check_set(value: torch.Tensor, name: str) -> None:
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        raise ValueError(
            f"parameter {name!r} of a model built on the meta device was not set by its "
            f"initialization (its module has no reset_parameters, or the init skipped it): "
            f"give initialize weights= holding it, or an init_fn that sets it"
        )


def fill_by_init(
    model: nn.Module,
    targets: ParamTargets,
    plan: InitPlan,
    device: torch.device,
    peak: InitPeak,
    only: set[int] | None = None,
) -> None:
    """Initialize ``model`` module by module and write each parameter's kept pieces into
    ``targets`` (``only``: the ids of the parameters to fill; the rest are left alone).
    Holds one module's parameters at a time (counted in ``peak``)."""
    modules = [(n, m) for n, m in plan.order if any(p is not None for p in m._parameters.values())]
    with torch.no_grad():
        if plan.replay:
            for _name, m in modules:
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    with scratch(m, device) as made:
                        peak.note(sum(t.nbytes for t in made.values()))
                        reset()
        # a tied parameter takes its values from the first module holding it (the name it
        # is saved under); the others' scratch copies still draw from the RNG as eagerly
        owner: dict[int, int] = {}
        for _, m in list(model.named_modules()):
            for p in m._parameters.values():
                if p is not None:
                    owner.setdefault(id(p), id(m))
        for name, m in modules:
            originals = dict(m._parameters)
            with scratch(m, device) as made:
                peak.note(sum(t.nbytes for t in made.values()))
                plan.hook(name, m)
                for key, real in made.items():
                    param = originals[key]
                    assert param is not None
                    if owner[id(param)] == id(m) and (only is None or id(param) in only):
                        _check_set(real, f"{name}.{key}" if name else key)
                        targets.write_whole(param, real.detach())


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
            fill_by_init(module, targets, plan, engine.device, peak, only=left)
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

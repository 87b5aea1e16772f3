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
Face model's constructors and ``_init_weights`` replayed in its eager build's order, checked
op by op against it first (``deferred.eager_replay``: bitwise equal to ``Model(config)`` under
the same seed; a model whose order cannot be checked gets its ``_init_weights`` alone, with a
warning); else the module's ``reset_parameters()``. A parameter nothing filled is an error
naming it. Buffers are computed with the random state put back after, so they never shift the
parameters' draws.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from shardwise.deferred import eager_replay
from shardwise.deferred.peak import InitPeak
from shardwise.zero.flat_param import make_real

InitFn = Callable[[nn.Module], None]
Hook = Callable[[str, nn.Module], None]

__all__ = ["InitFn", "deferred_init", "materialize_kept", "target_device"]


class Targets(Protocol):
    """Where a whole initialized parameter's kept pieces go (the engine's flat shards, or the
    parameter's own tensor)."""

    def write_whole(self, param: torch.Tensor, local: torch.Tensor) -> None: ...


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
    hf: bool = False  # a Hugging Face model: its eager build's order is replayed if it checks


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
        hf_model = eager_replay.is_hf_model(model)
        return InitPlan(lambda name, m: hf(m), _postorder(model), replay=False, hf=hf_model)

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
        with scratch(m, device), torch.no_grad(), eager_replay.rng_kept():
            plan.hook(name, m)


def _check_set(value: torch.Tensor, name: str) -> None:
    # checked in pieces: a mask of the whole would be a quarter of the tensor again
    pieces = value.reshape(-1).split(1 << 16)
    if value.is_floating_point() and any(bool(torch.isnan(c).any()) for c in pieces):
        raise ValueError(
            f"parameter {name!r} of a model built on the meta device was not set by its "
            f"initialization (its module has no reset_parameters, or the init skipped it): "
            f"give initialize weights= holding it, or an init_fn that sets it"
        )


def fill_by_init(
    model: nn.Module,
    targets: Targets,
    plan: InitPlan,
    device: torch.device,
    peak: InitPeak,
    only: set[int] | None = None,
    eager: bool = True,
) -> None:
    """Initialize ``model`` module by module and write each parameter's kept pieces into
    ``targets`` (``only``: the ids of the parameters to fill; the rest are left alone).
    Holds one module's parameters at a time (counted in ``peak``). ``eager`` False: a
    Hugging Face model's missing weights get its ``_init_weights`` (as ``from_pretrained``
    gives them), without replaying the whole eager build's draws."""
    if plan.hf and eager:
        replay = eager_replay.verified_replay(model, scratch)
        if replay is not None:
            fill_by_replay(model, targets, replay, device, peak, only)
            return
    modules = [(n, m) for n, m in plan.order if any(p is not None for p in m._parameters.values())]
    first = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        if plan.replay:
            for _, m in modules:
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    _step((m,), reset, lambda p, m: False, first, targets, device, peak)
        # a tied parameter takes its values from the first module holding it (the name it
        # is saved under); the others' scratch copies still draw from the RNG as eagerly
        holder = eager_replay.holders(model)

        def writes(p: nn.Parameter, m: nn.Module) -> bool:
            return holder[id(p)] is m and (only is None or id(p) in only)

        for name, m in modules:
            _step((m,), functools.partial(plan.hook, name, m), writes, first, targets, device, peak)


def _step(
    modules: tuple[nn.Module, ...],
    run: Callable[[], object],
    writes: Callable[[nn.Parameter, nn.Module], bool],
    first: dict[int, str],
    targets: Targets,
    device: torch.device,
    peak: InitPeak,
) -> None:
    """``run()`` on ``modules``' scratch parameters, then the kept pieces of those ``writes``
    accepts (a parameter and the module holding it) written to ``targets``. Its own
    function: the scratch tensors are freed on return, before the next step's are made."""
    with ExitStack() as stack:
        held = [(m, dict(m._parameters), stack.enter_context(scratch(m, device))) for m in modules]
        peak.note(sum(t.nbytes for _, _, made in held for t in made.values()))
        run()
        for m, originals, made in held:
            for key, real in made.items():
                param = originals[key]
                assert param is not None
                if writes(param, m):
                    _check_set(real, first[id(param)])
                    targets.write_whole(param, real.detach())


def fill_by_replay(
    model: nn.Module,
    targets: Targets,
    replay: eager_replay.Replay,
    device: torch.device,
    peak: InitPeak,
    only: set[int] | None = None,
) -> None:
    """Run ``replay``'s steps in order, each on its modules' scratch parameters, writing the
    kept pieces of what a step writes whole (the last such step gives a parameter's value)."""
    first = {id(p): n for n, p in model.named_parameters()}
    holder = eager_replay.holders(model)
    with torch.no_grad():
        for i, step in enumerate(replay.steps):

            def writes(p: nn.Parameter, m: nn.Module, i: int = i) -> bool:
                mine = holder[id(p)] is m and (i, first[id(p)]) in replay.touches
                return mine and (only is None or id(p) in only)

            _step(step.modules(), step.run, writes, first, targets, device, peak)


def materialize_kept(
    model: nn.Module,
    kept: nn.Module,
    device: torch.device | None = None,
    init_fn: InitFn | None = None,
) -> InitPeak:
    """Make the meta parameters and buffers ``kept`` holds (a part of ``model``, built on the
    meta device: one pipeline stage's modules) real on ``device`` (default ``target_device()``),
    with the values ``model``'s initialization gives them (see the module docstring: the
    built-in GPT and Hugging Face models equal their eager build under the same random state,
    bitwise). The whole model's initialization runs one module at a time on scratch tensors,
    so the rank holds what it keeps plus one module; the rest of ``model`` stays on the meta
    device. Returns the peak (its transient part: the largest module). Communicates nothing."""
    device = device or target_device()
    plan = init_plan(model, init_fn)
    mine = {id(m) for m in kept.modules()}
    kept_order = [(n, m) for n, m in plan.order if id(m) in mine]
    materialize_buffers(model, dataclasses.replace(plan, order=kept_order), device)
    params = {id(p): p for p in kept.parameters() if p.is_meta}
    for p in params.values():
        make_real(p, device)
        p.data = torch.zeros(p.shape, dtype=p.dtype, device=device)
    peak = InitPeak()
    peak.set_base(sum(p.nbytes for p in kept.parameters()))
    targets = WholeParams()
    fill_by_init(model, targets, plan, device, peak, only=set(params))
    missing = [
        n for n, p in kept.named_parameters() if id(p) in params and id(p) not in targets.filled
    ]
    if missing:
        raise ValueError(
            f"parameters {missing[:5]} of the kept modules were not set by the model's "
            f"initialization: give an init_fn that sets them"
        )
    return peak


class WholeParams:
    """Parameters kept whole by their own tensors (a pipeline stage before ZeRO): a write
    copies the whole value in; records which were filled."""

    def __init__(self) -> None:
        self.filled: set[int] = set()

    def write_whole(self, param: torch.Tensor, local: torch.Tensor) -> None:
        """Set ``param`` to ``local``."""
        with torch.no_grad():
            param.data.copy_(local)
        self.filled.add(id(param))

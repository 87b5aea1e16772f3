"""A Hugging Face model built on the meta device, initialized unit by unit to the values an eager
build gets under the same seed, bitwise.

An eager ``Model(config)`` draws twice: each torch layer's constructor draws its own weights
(``reset_parameters``) as it is built, and every ``PreTrainedModel``'s ``post_init``, at the end
of its own constructor, redraws them with ``_init_weights``, children before parents, skipping
modules an inner model's ``post_init`` already did (so a ``...ForCausalLM`` draws its base
model's constructors, its base model's ``_init_weights``, then its head's constructor and the
head's ``_init_weights``). Weights tied after ``post_init`` were drawn apart first. The replay
runs these steps in that order, each on one module's scratch parameters.

The order is derived from the model's structure, then checked before anything real is drawn:
the model is rebuilt from its config on the meta device with its initialization running (see
``op_record.MetaFactories``) and its random draws and writes recorded; the replay is recorded
the same way; the two records must be equal op by op, and no step may read a parameter before
writing it whole or write only part of it. A first replay finds what the steps write beyond
their module (GPT-2's attention rescales its child ``c_proj``: that step then holds the child's
parameters too) and, for a module without ``reset_parameters`` whose constructor draws in
place on its own parameters (GPT-2's ``Conv1D``), those recorded ops, replayed in its place.
A model whose records still differ is initialized by its ``_init_weights`` alone, with a
warning naming the first difference and saying that the values will not equal an eager
build's: e.g. a constructor drawing out of place (``nn.Parameter(torch.randn(...))``), or a
model that cannot be rebuilt from its config alone or rebuilds with other parameters.

The draws happen where the pieces are made (``materialize.target_device()``): on a machine
without CUDA that is the CPU generator, as ``Model(config)`` uses; with CUDA the values equal
an eager build under ``torch.device("cuda")``, not a CPU one.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.deferred.op_record import MetaFactories, OpRecord, Touch, storage

log = logging.getLogger("shardwise")

__all__ = ["Replay", "Step", "holders", "is_hf_model", "rng_kept", "verified_replay"]


def _pretrained_class() -> type | None:
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    return PreTrainedModel


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel``."""
    cls = _pretrained_class()
    return cls is not None and isinstance(model, cls)


@dataclass(frozen=True)
class Step:
    """One module's random draws of an eager build: its constructor's (``reset``) or a
    ``post_init``'s ``_init_weights`` (``init``, by the innermost model holding it)."""

    kind: str
    name: str
    module: nn.Module
    owner: nn.Module | None = None
    extra: tuple[nn.Module, ...] = ()  # other modules whose parameters the step writes
    ops: tuple[tuple[Any, str, tuple[Any, ...], dict[str, Any]], ...] = ()  # ``record``

    def modules(self) -> tuple[nn.Module, ...]:
        """The modules whose own parameters the step holds as scratch."""
        return (self.module, *self.extra)

    def run(self) -> None:
        """Draw and write as the eager build did, on the module's current parameters."""
        if self.kind == "reset":
            self.module.reset_parameters()  # type: ignore[operator]
            return
        if self.kind == "record":  # a constructor's in-place ops on its own parameters
            for func, key, rest, kwargs in self.ops:
                func(self.module._parameters[key], *rest, **kwargs)
            return
        assert self.owner is not None
        with _hf_guard():
            self.owner._init_weights(self.module)  # type: ignore[operator]


def _hf_guard() -> Any:
    """Hugging Face's own guard around its initialization (torch's init functions made to
    respect its already-initialized marks), as ``initialize_weights`` runs it."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # an older transformers: no guard
        return nullcontext()
    return guard_torch_init_functions()


def _has_direct(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


Ops = tuple[tuple[Any, str, tuple[Any, ...], dict[str, Any]], ...]


def eager_steps(
    model: nn.Module,
    recorded: dict[str, Ops] | None = None,
    extra: dict[tuple[str, str], tuple[str, ...]] | None = None,
) -> list[Step]:
    """The steps of ``model``'s eager build, in order (see the module docstring).
    ``recorded``: per module name, its constructor's ops on its own parameters (a module
    without ``reset_parameters``); ``extra``: per (kind, name) step, the other modules whose
    parameters it writes."""
    recorded, extra = recorded or {}, extra or {}
    cls = _pretrained_class()
    assert cls is not None
    built: set[int] = set()
    inited: set[int] = set()
    steps: list[Step] = []

    def init(module: nn.Module, name: str, owner: nn.Module) -> None:  # post_init's order
        for key, child in module.named_children():
            init(child, f"{name}{key}.", child if isinstance(child, cls) else owner)
        if id(module) not in inited:
            inited.add(id(module))
            # remote code skips a module whose own tensors are all initialized: at
            # construction, one that has none
            bare = not _has_direct(module) and all(b is None for b in module._buffers.values())
            custom = getattr(owner, "is_custom_code", lambda: False)()
            if not (bare and custom):
                key = name.rstrip(".")
                more = tuple(model.get_submodule(n) for n in extra.get(("init", key), ()))
                steps.append(Step("init", key, module, owner, more))

    def build(module: nn.Module, name: str) -> None:  # constructors, children first
        if id(module) in built:
            return
        built.add(id(module))
        for key, child in module.named_children():
            build(child, f"{name}{key}.")
        if _has_direct(module) and callable(getattr(module, "reset_parameters", None)):
            steps.append(Step("reset", name.rstrip("."), module))
        elif recorded.get(name.rstrip(".")):
            steps.append(Step("record", name.rstrip("."), module, ops=recorded[name.rstrip(".")]))
        if isinstance(module, cls):
            init(module, name, module)

    build(model, "")
    return steps


@contextmanager
def rng_kept() -> Iterator[None]:
    """Random state restored after the block: recording draws nothing from the real stream."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _storages(model: nn.Module) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out.setdefault(storage(t), name)
    return out


def _structure(model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    both = [*model.named_parameters(), *model.named_buffers()]
    return [(n, tuple(t.shape), t.dtype) for n, t in both]


@dataclass(frozen=True)
class Replay:
    """Checked steps and what each does: ``touches[(step, name)]`` for the parameters a step
    writes whole (by their first name)."""

    steps: list[Step]
    touches: dict[tuple[int, str], Touch]


def _record_eager(model: nn.Module) -> tuple[nn.Module, OpRecord]:
    """``model`` rebuilt from its config on the meta device, and its eager record."""
    record = OpRecord()
    with rng_kept(), MetaFactories(), record:
        rebuilt = type(model)(copy.deepcopy(model.config))
    if _structure(rebuilt) != _structure(model):
        raise ValueError("rebuilt from its config it has other parameters or buffers")
    return rebuilt, record


def holders(model: nn.Module) -> dict[int, nn.Module]:
    """Each parameter's first holder (by id): the module whose steps write it. A tied
    parameter's other holders draw, as eagerly, but write nothing."""
    out: dict[int, nn.Module] = {}
    for _, m in model.named_modules():
        for p in m._parameters.values():
            if p is not None:
                out.setdefault(id(p), m)
    return out


@contextmanager
def step_scratch(
    step: Step, scratch: Callable[..., Any], device: torch.device
) -> Iterator[list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]]:
    """Scratch parameters for every module of ``step``: (module, made, originals) each."""
    with ExitStack() as stack:
        out = []
        for m in step.modules():
            originals = dict(m._parameters)
            out.append((m, stack.enter_context(scratch(m, device)), originals))
        yield out


def record_replay(
    model: nn.Module, steps: list[Step], scratch: Callable[..., Any]
) -> tuple[list[Any], OpRecord]:
    """The record of replaying ``steps`` on meta scratch parameters of ``model``."""
    first = {id(p): n for n, p in model.named_parameters()}
    holder = holders(model)
    record = OpRecord()
    # a write into a parameter outside the running step's scratch would be lost in the replay:
    # named apart, it can never equal the eager record
    for name, p in model.named_parameters():
        record.names[storage(p)] = f"{name} (outside its step)"
    with rng_kept(), torch.no_grad():
        for i, step in enumerate(steps):
            with step_scratch(step, scratch, torch.device("meta")) as held:
                for m, made, originals in held:
                    record.keep(made.values())  # named by storage: no address may be reused
                    for key, real in made.items():
                        if holder[id(originals[key])] is m:
                            record.names[storage(real)] = first[id(originals[key])]
                record.step = i
                with record:
                    step.run()
    buffers = {storage(b): n for n, b in model.named_buffers()}
    return record.named({**record.names, **buffers}), record


def _constructor_ops(
    rebuilt: nn.Module, eager: OpRecord, init_writes: dict[str, int]
) -> dict[str, Ops]:
    """Per module without ``reset_parameters``: the eager build's ops on its own parameters
    before ``post_init`` (those beyond the init steps' own writes), each on the whole
    parameter with plain arguments; a module whose ops are not all so is left out (the
    records then differ)."""
    by_storage = {storage(p): n for n, p in rebuilt.named_parameters()}
    ops: dict[str, list[Any]] = {}
    for func, args, kwargs, written in eager.raw:
        for s in written:
            if s in by_storage:
                ops.setdefault(by_storage[s], []).append((func, args, kwargs))
    out: dict[str, Ops] = {}
    for mname, module in rebuilt.named_modules():
        if callable(getattr(module, "reset_parameters", None)) or not _has_direct(module):
            continue
        mine: list[Any] = []
        for key, p in module._parameters.items():
            name = f"{mname}.{key}" if mname else key
            done = ops.get(name, [])
            for func, args, kwargs in done[: len(done) - init_writes.get(name, 0)]:
                plain = not any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))
                if not plain or p is None or args[0].shape != p.shape:
                    break
                mine.append((func, key, tuple(args[1:]), dict(kwargs)))
        if mine:
            out[mname] = tuple(mine)
    return out


def verified_replay(model: nn.Module, scratch: Callable[..., Any]) -> Replay | None:
    """``model``'s eager steps, checked against its eager build (see the module docstring);
    None, with a warning naming why, when they cannot be."""
    try:
        rebuilt, eager_record = _record_eager(model)
    except Exception as exc:  # any failure to rebuild means: cannot check
        why = f"it could not be rebuilt from its config to check the order ({exc})"
        return _refused(model, why)
    eager = eager_record.named(_storages(rebuilt))
    # first pass: what the init steps write, also outside their module
    _, first = record_replay(rebuilt, eager_steps(rebuilt), scratch)
    module_of = {n: n.rpartition(".")[0] for n, _ in rebuilt.named_parameters()}
    extra: dict[tuple[str, str], set[str]] = {}
    steps0 = eager_steps(rebuilt)
    for (i, name), _touch in first.touches.items():
        if name.endswith(" (outside its step)") and steps0[i].kind == "init":
            owner = module_of[name.removesuffix(" (outside its step)")]
            extra.setdefault(("init", steps0[i].name), set()).add(owner)
    init_writes: dict[str, int] = {}
    for n, c in first.writes.items():
        key = n.removesuffix(" (outside its step)")
        init_writes[key] = init_writes.get(key, 0) + c
    recorded = _constructor_ops(rebuilt, eager_record, init_writes)
    more = {k: tuple(sorted(v)) for k, v in extra.items()}
    replayed, second = record_replay(rebuilt, eager_steps(rebuilt, recorded, more), scratch)
    for i, (a, b) in enumerate(zip(eager, replayed)):
        if a != b:
            return _refused(model, f"its eager build's draw {i} is {a}, the replay's {b}")
    if len(eager) != len(replayed):
        return _refused(
            model,
            f"its eager build makes {len(eager)} draws and writes, the replay {len(replayed)}",
        )
    for (i, name), touch in second.touches.items():
        if touch.read_first or (touch.partial and not touch.whole):
            return _refused(model, f"step {i} reads or writes part of {name!r} only")
    steps = eager_steps(model, recorded, more)
    return Replay(steps, {k: t for k, t in second.touches.items() if t.whole})


def _refused(model: nn.Module, why: str) -> Replay | None:
    log.warning(
        "%s built on the meta device is initialized by its _init_weights alone, its values not "
        "equal to an eager build's under the same seed: %s",
        type(model).__name__,
        why,
    )
    return None

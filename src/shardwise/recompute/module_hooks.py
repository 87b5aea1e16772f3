"""Activation checkpointing applied from outside a model: one forward pre-hook and one forward
hook per checkpointed module (see the package docstring for how a hooked region recomputes).
Nothing here communicates.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle


@dataclass(eq=False)
class _Unit:
    """Bookkeeping for one checkpointed module (kept in `_UNITS`, never on the module)."""

    preserve_rng_state: bool
    handles: list[RemovableHandle] = field(default_factory=list)


@dataclass(eq=False)
class _RngState:
    """RNG state at region entry: the CPU generator and the CUDA devices the inputs live on."""

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]

    @classmethod
    def capture(cls, inputs: list[torch.Tensor]) -> _RngState:
        devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
        if not devices and torch.cuda.is_initialized():
            devices = [torch.cuda.current_device()]
        return cls(torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices})

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body from this state; the generators are put back afterwards."""
        with torch.random.fork_rng(devices=list(self.cuda), device_type="cuda"):
            torch.set_rng_state(self.cpu)
            for device, state in self.cuda.items():
                torch.cuda.set_rng_state(state, device)
            yield


@dataclass(eq=False)
class _Slot:
    """Stands in for one tensor autograd saved inside a region; holds it only after recompute."""

    frame: _Frame
    meta: tuple[torch.Size, torch.dtype, torch.device]
    tensor: torch.Tensor | None = None


@dataclass(eq=False)
class _Frame:
    """One forward call of a checkpointed module: what is needed to run it again."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: _RngState | None
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    slots: list[weakref.ref[_Slot]] = field(default_factory=list)
    cursor: int = 0  # next slot to fill while recording
    entered: bool = False  # the recompute call reached our pre-hook

    def pack(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(self, (tensor.shape, tensor.dtype, tensor.device))
        self.slots.append(weakref.ref(slot))
        return slot

    def record(self, tensor: torch.Tensor) -> object:
        """Pack hook of the recompute: hand the regenerated tensor to its slot, in order."""
        index = self.cursor
        self.cursor += 1
        if index >= len(self.slots):
            raise RuntimeError(
                f"recomputing {type(self.module).__name__} saved more tensors than its forward "
                f"({len(self.slots)}); its forward must run the same ops given the same inputs"
            )
        slot = self.slots[index]()
        if slot is not None:  # None: autograd already released it (that node has run)
            meta = (tensor.shape, tensor.dtype, tensor.device)
            if meta != slot.meta:
                raise RuntimeError(
                    f"recomputing {type(self.module).__name__} regenerated saved tensor {index} "
                    f"as {meta}, but the forward saved {slot.meta}; its forward must be "
                    "deterministic in shapes, dtypes and devices"
                )
            slot.tensor = tensor.detach()  # drop the recompute graph, keep the data
        return _RECORDED

    def recompute(self) -> None:
        """Call the module again so that every slot still alive gets its tensor back."""
        outer_pending = _STATE.pending
        _STATE.pending, self.entered, self.cursor = self, False, 0
        _STATE.recomputing += 1
        try:
            with ExitStack() as stack:
                stack.enter_context(torch.enable_grad())
                if self.rng is not None:
                    stack.enter_context(self.rng.restored())
                for device_type, enabled, dtype in self.autocast:
                    cache = self.autocast_cache
                    stack.enter_context(torch.autocast(device_type, dtype, enabled, cache))
                self.module(*self.args, **self.kwargs)
        finally:
            _STATE.pending = outer_pending
            _STATE.recomputing -= 1
        name = type(self.module).__name__
        if not self.entered:
            raise RuntimeError(
                f"recomputing {name} did not reach its checkpoint hook; was "
                "remove_activation_checkpointing called before backward ran?"
            )
        if self.cursor != len(self.slots):
            raise RuntimeError(
                f"recomputing {name} saved {self.cursor} tensors, its forward saved "
                f"{len(self.slots)}; its forward must run the same ops given the same inputs"
            )


_RECORDED = object()  # what the recompute's own graph saves: nothing usable


def _unpack_slot(slot: _Slot) -> torch.Tensor:
    if slot.tensor is None:
        slot.frame.recompute()
    tensor = slot.tensor
    assert tensor is not None, "recompute filled every live slot"
    slot.tensor = None  # autograd unpacks once per backward; give the memory back now
    return tensor


def _unpack_recorded(packed: object) -> torch.Tensor:
    raise RuntimeError("the graph built while recomputing activations cannot be backpropagated")


@dataclass(eq=False)
class _OpenCall:
    """A hooked module call in flight on this thread (pre-hook ran, forward hook not yet)."""

    unit: _Unit
    hooks: saved_tensors_hooks | None  # None: this call runs inside another region


class _ThreadState(threading.local):
    """Per-thread state: which hooked calls are open and whether a recompute is running."""

    def __init__(self) -> None:
        self.open: list[_OpenCall] = []
        self.regions = 0  # open calls that installed saved-tensor hooks
        self.recomputing = 0
        self.pending: _Frame | None = None  # frame whose recompute call is about to start


_STATE = _ThreadState()
_UNITS: weakref.WeakKeyDictionary[nn.Module, _Unit] = weakref.WeakKeyDictionary()


def is_recomputing() -> bool:
    """True while a checkpointed module's forward is being run again during backward.

    Hooks of other code (e.g. a ZeRO engine's forward hooks) can use it to tell the recompute
    from the first forward. Per thread; communicates nothing.
    """
    return _STATE.recomputing > 0


def _detach_tree(tree: Any, found: list[torch.Tensor]) -> Any:
    """Detached aliases of the tensors in plain tuples, lists and dicts (also put in ``found``)."""
    if isinstance(tree, torch.Tensor):
        found.append(tree.detach().requires_grad_(tree.requires_grad))
        return found[-1]
    if type(tree) in (tuple, list):
        return type(tree)(_detach_tree(item, found) for item in tree)
    if type(tree) is dict:
        return {key: _detach_tree(value, found) for key, value in tree.items()}
    return tree


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    device_types = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return tuple(
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in device_types
    )


def _open_forward_region(unit: _Unit, module: nn.Module, args: Any, kwargs: Any) -> _Frame:
    tensors: list[torch.Tensor] = []
    args, kwargs = _detach_tree(tuple(args), tensors), _detach_tree(dict(kwargs), tensors)
    rng = _RngState.capture(tensors) if unit.preserve_rng_state else None
    return _Frame(module, args, kwargs, rng, _autocast_state(), torch.is_autocast_cache_enabled())


def _pre_hook(unit: _Unit, module: nn.Module, args: Any, kwargs: Any) -> None:
    frame = _STATE.pending
    if frame is not None and frame.module is module:
        _STATE.pending, frame.entered = None, True
        hooks = saved_tensors_hooks(frame.record, _unpack_recorded)
    elif _STATE.regions == 0 and torch.is_grad_enabled():
        frame = _open_forward_region(unit, module, args, kwargs)
        hooks = saved_tensors_hooks(frame.pack, _unpack_slot)
    else:
        # Inside another region (or a recompute), which already covers this call; or no grad.
        _STATE.open.append(_OpenCall(unit, None))
        return
    hooks.__enter__()
    _STATE.regions += 1
    _STATE.open.append(_OpenCall(unit, hooks))


def _post_hook(unit: _Unit, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    # ``always_call`` also runs this when an earlier pre-hook raised before ours ran.
    if not _STATE.open or _STATE.open[-1].unit is not unit:
        return
    call = _STATE.open.pop()
    if call.hooks is not None:
        _STATE.regions -= 1
        call.hooks.__exit__(None, None, None)


def _matches(module: nn.Module, cls: type | str) -> bool:
    if isinstance(cls, str):
        kind = type(module)
        return cls in (kind.__name__, kind.__qualname__, f"{kind.__module__}.{kind.__qualname__}")
    return isinstance(module, cls)


def _check_classes(classes: Sequence[type | str]) -> list[type | str]:
    if isinstance(classes, str) or not isinstance(classes, Sequence):
        raise TypeError(
            f"classes must be a sequence of module classes or class names, e.g. ['Block']; "
            f"got {classes!r}"
        )
    if not classes:
        raise ValueError("classes is empty; name at least one module class to checkpoint")
    for cls in classes:
        if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"classes entries must be nn.Module subclasses or class names; got {cls!r}"
            )
    return list(classes)


def _check_no_cache(model: nn.Module) -> None:
    """A model that caches keys and values (HF-style ``config.use_cache``) would append to its
    cache again when a block is recomputed."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            where = f"{name}.config" if name else "model.config"
            raise ValueError(
                f"activation checkpointing cannot run with a key/value cache: {where}.use_cache "
                "is True, and a recomputed block would append to the cache a second time. Set "
                f"{where}.use_cache = False for training (generation may pass use_cache=True)"
            )


def apply_activation_checkpointing(
    model: nn.Module, classes: Sequence[type | str], *, preserve_rng_state: bool = True
) -> int:
    """Make every submodule of the given classes recompute its activations during backward.

    A submodule matches a class object when it is an instance of it (subclasses included) and a
    string when the string equals its class's ``__name__``, ``__qualname__`` or
    ``module.qualname``. Each match gets a forward pre-hook and a forward hook, both prepended so
    they see the caller's inputs before other hooks change them; the model's code, structure,
    parameter names and state_dict keys do not change. In backward the module is called again
    through ``nn.Module.__call__``, so forward hooks registered by other code fire again for the
    recompute (`is_recomputing` tells them apart). A matching module that runs inside another
    checkpointed module is covered by the outer one. Apply this before hook-based wrappers such
    as ZeRO so that their pre-hooks run inside the region.

    Calling it again is safe: modules already checkpointed are skipped (and keep their options).

    Args:
        model: the model; the root itself is checkpointed too if it matches.
        classes: module classes, or their names, e.g. ``["Block"]``.
        preserve_rng_state: restore the CPU RNG and the RNG of the CUDA devices the inputs live
            on before recomputing, so that dropout masks repeat.

    Returns:
        The number of modules newly checkpointed by this call.

    Raises:
        ValueError: an entry of ``classes`` matches no module of ``model``, or a module of the
            model has a ``config`` whose ``use_cache`` is True (set it to False for training).
    """
    wanted = _check_classes(classes)
    _check_no_cache(model)
    modules = list(model.modules())
    for cls in wanted:
        if not any(_matches(module, cls) for module in modules):
            label = cls if isinstance(cls, str) else cls.__name__
            present = ", ".join(sorted({type(module).__name__ for module in modules}))
            raise ValueError(
                f"no submodule of the model is a {label!r}; pick classes from the model's "
                f"module classes: {present}"
            )
    wrapped = 0
    for module in modules:
        if module in _UNITS or not any(_matches(module, cls) for cls in wanted):
            continue
        unit = _Unit(preserve_rng_state)
        unit.handles.append(
            module.register_forward_pre_hook(
                partial(_pre_hook, unit), prepend=True, with_kwargs=True
            )
        )
        unit.handles.append(
            module.register_forward_hook(
                partial(_post_hook, unit), prepend=True, with_kwargs=True, always_call=True
            )
        )
        _UNITS[module] = unit
        wrapped += 1
    return wrapped


def remove_activation_checkpointing(model: nn.Module) -> int:
    """Undo `apply_activation_checkpointing` for every submodule of ``model``.

    Call it when no backward is pending: a graph recorded with checkpointing still needs the
    hooks to recompute. Returns the number of modules unwrapped.
    """
    removed = 0
    for module in model.modules():
        unit = _UNITS.pop(module, None)
        if unit is None:
            continue
        for handle in unit.handles:
            handle.remove()
        removed += 1
    return removed

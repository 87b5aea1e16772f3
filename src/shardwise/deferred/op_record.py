"""Recording what an initialization does, op by op, on meta tensors: which random draws it
makes (in order, with their shapes and arguments) and which parameters and buffers it writes.

Two recordings of the same named tensors are equal exactly when the two initializations draw
the same random numbers in the same order and write them to the same places, so a replay whose
record equals an eager build's produces the eager build's values, bitwise. Nothing is
allocated: every tensor involved is on the meta device.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that consume the random number generator
RANDOM_OPS = frozenset(
    {
        "normal",
        "normal_",
        "uniform_",
        "bernoulli",
        "bernoulli_",
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
        "multinomial",
        "poisson",
        "native_dropout",
    }
)
# in-place ops whose result does not depend on the values they overwrite
OVERWRITES = frozenset(
    {"normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "log_normal_"}
    | {"cauchy_", "random_", "fill_", "zero_", "copy_"}
)

Entry = tuple[Hashable, ...]


def storage(t: torch.Tensor) -> int:
    """An id of ``t``'s storage (views share it)."""
    return int(t.untyped_storage()._cdata)


def _base_name(func: Any) -> str:
    return str(func._schema.name).split("::")[-1]


class MetaFactories(TorchFunctionMode):
    """Tensor factories without a device make meta tensors (as ``torch.device("meta")``), but
    the default device still reads as the real one, so code that skips its initialization on
    the meta device (Hugging Face's ``init_weights``) runs it, on meta tensors. ``torch.tensor``
    stays real: that check builds an empty one to read the current device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func in _device_constructors() and func is not torch.tensor:
            if kwargs.get("device") is None:
                kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


@dataclass
class Touch:
    """What one step did to one parameter: written whole by an op that ignores the old values
    (``whole``), written in part only (``partial``), or read before it was written whole
    (``read_first``)."""

    whole: bool = False
    partial: bool = False
    read_first: bool = False


@dataclass
class OpRecord(TorchDispatchMode):
    """Records, while active, each random op and each op writing into a tensor, with its
    tensors by storage; ``named`` then keeps the random ops and the writes into named
    storages, as comparable entries. ``names`` (storage -> name, known ahead) and ``step``:
    ``touches`` says per (step, name) what that step did to each named tensor."""

    names: dict[int, str] = field(default_factory=dict)
    touches: dict[tuple[int, str], Touch] = field(default_factory=dict)
    step: int = 0
    writes: dict[str, int] = field(default_factory=dict)  # per named tensor: ops writing it
    raw: list[tuple[Any, tuple[Any, ...], dict[str, Any], list[int]]] = field(default_factory=list)
    _alive: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def _note(self, func: Any, args: tuple[Any, ...]) -> list[int]:
        """The storages ``func`` writes; what it does to named ones goes into ``touches``."""
        written = []
        base = _base_name(func)
        for schema_arg, a in zip(func._schema.arguments, args):
            if not isinstance(a, torch.Tensor):
                continue
            writes = schema_arg.alias_info is not None and schema_arg.alias_info.is_write
            if writes:
                written.append(storage(a))
            name = self.names.get(storage(a))
            if name is None:
                continue
            self.writes[name] = self.writes.get(name, 0) + int(writes)
            touch = self.touches.setdefault((self.step, name), Touch())
            if writes and base in OVERWRITES:
                covers = a.numel() * a.element_size() == a.untyped_storage().nbytes()
                touch.whole = touch.whole or covers
                touch.partial = touch.partial or not covers
            elif not touch.whole:
                touch.read_first = True
        return written

    def keep(self, tensors: Any) -> None:
        """Keep ``tensors`` alive while the record is used (meta: they hold no memory), so no
        storage a name was given to is freed and its address reused by another."""
        self._alive.append(list(tensors))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._alive.append((args, out))  # no storage is freed (and its address reused) meanwhile
        written = self._note(func, tuple(args))
        if written or _base_name(func) in RANDOM_OPS:
            self.raw.append((func, tuple(args), dict(kwargs), written))
        return out

    def named(self, names: dict[int, str]) -> list[Entry]:
        """The random ops and the writes into storages ``names`` holds (storage -> name), in
        order, each with its tensors by name and geometry (others by dtype and shape)."""

        def arg(a: Any) -> Hashable:
            if isinstance(a, torch.Tensor):
                name = names.get(storage(a))
                geometry = (tuple(a.shape), tuple(a.stride()), a.storage_offset(), str(a.dtype))
                return (name, *geometry) if name else ("tensor", str(a.dtype), tuple(a.shape))
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            if isinstance(a, (int, float, bool, str, type(None))):
                return a
            return str(a)

        return [
            (_base_name(f), arg(args), tuple(sorted((k, arg(v)) for k, v in kwargs.items())))
            for f, args, kwargs, written in self.raw
            if _base_name(f) in RANDOM_OPS or any(s in names for s in written)
        ]

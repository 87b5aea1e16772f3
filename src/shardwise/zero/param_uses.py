"""Stage 3: parameters used outside the call of the module that owns them.

A forward may pass another module's parameter to a torch function (a tied head computed as
``F.linear(h, self.emb.weight)`` in the root's forward, a unit reading a sibling's weight through
a plain reference). ``ExternalUses`` is a torch function mode, active while a forward pass runs,
that gathers such a parameter for that use and holds it until the pass ends; a unit found using a
buffer it does not need learns that need, so later passes and recomputes gather it up front.
Parameters of the running units are already gathered: checking them is one dictionary lookup
per tensor argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.zero.flat_param import FlatParam
from shardwise.zero.sharded_param import call_args


class Schedule(Protocol):
    """What ``ExternalUses`` needs of the stage-3 schedule (``ParamSchedule``)."""

    flats: list[FlatParam]

    def innermost_unit(self) -> nn.Module | None: ...

    def needs_of(self, module: nn.Module) -> list[FlatParam]: ...

    def learn_need(self, f: FlatParam) -> None: ...

    def borrow(self, f: FlatParam) -> None: ...


class ExternalUses(TorchFunctionMode):
    """Gathers sharded parameters that torch functions receive outside their units' calls."""

    def __init__(self, schedule: Schedule) -> None:
        super().__init__()
        self.schedule = schedule
        self.flat_of = {id(p): f for f in schedule.flats for p in f.params}
        self.borrowed: list[FlatParam] = []  # gathered for uses in this pass
        self._active = False

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # attribute reads and writes touch no data (the engine's own ``p.data = view`` when a
        # unit's gather completes inside another unit's call is not a use by that unit)
        if getattr(func, "__name__", "") not in ("__get__", "__set__"):
            for a in call_args(args, kwargs):
                self._check(a)
        return func(*args, **kwargs)

    def _check(self, value: Any) -> None:
        f = self.flat_of.get(id(value))
        if f is None:
            return
        unit = self.schedule.innermost_unit()
        if unit is not None:
            if f in self.schedule.needs_of(unit):
                return
            self.schedule.learn_need(f)
        if f not in self.borrowed:
            self.schedule.borrow(f)

    # ---- activation, driven by the schedule ----

    def start(self) -> None:
        self.__enter__()
        self._active = True

    def stop(self) -> None:
        if self._active:
            self._active = False
            self.__exit__(None, None, None)

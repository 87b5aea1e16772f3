"""Stage 3: parameters used outside the call of the module that owns them.

A forward may pass another module's parameter to a torch function (a tied head computed as
``F.linear(h, self.emb.weight)`` in the root's forward, a unit reading a sibling's weight).
``ExternalUses`` is a torch function mode that is active while the outermost hooked call's own
code runs (paused inside nested units, whose parameters are gathered by their hooks) and, in the
first forward pass, inside nested units too: a parameter of a sharded buffer passed to a torch
function is gathered for that use and held until the pass ends; a unit found using a buffer it
does not need learns that need for later passes. A use it cannot see (after the first pass,
inside a nested unit) fails in torch with an out-of-bounds storage error, to which
``explain_storage_error`` adds the parameter, its unit and the ``wrap_policy`` that avoids it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.overrides import TorchFunctionMode, _get_current_function_mode

from shardwise.zero.flat_param import FlatParam, ParamState

if TYPE_CHECKING:
    from shardwise.zero.param_schedule import ParamSchedule

_STORAGE_ERROR = re.compile(r"storage offset (\d+).*storage of size 0")


class ExternalUses(TorchFunctionMode):
    """Gathers sharded parameters that torch functions receive outside their units' calls."""

    def __init__(self, schedule: ParamSchedule) -> None:
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
        if getattr(func, "__name__", "") != "__get__":  # attribute reads touch no data
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)):
                    for b in a:
                        self._check(b)
                else:
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

    def pause(self, recording: bool) -> bool:
        """Entering a nested unit: stop watching (its parameters are gathered by its hooks)
        unless this is the recording pass or another mode was pushed above this one."""
        if recording or _get_current_function_mode() is not self:
            return False
        self.stop()
        return True

    def resume(self) -> None:
        self.start()


def _common_ancestor(a: str, b: str) -> str:
    out = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def explain_storage_error(error: BaseException, schedule: ParamSchedule, module: Any) -> None:
    """Add to torch's out-of-bounds error (a sharded parameter read while not gathered) the
    parameters it may be, their units, and the wrap policy that puts user and owner together."""
    match = _STORAGE_ERROR.search(str(error))
    if match is None or getattr(error, "_shardwise_explained", False):
        return
    offset = int(match.group(1))  # a view of the parameter starts inside its slot
    names = [
        name
        for f in schedule.flats
        if f.state is ParamState.SHARDED
        for name, slot in zip(f.names, f.slots)
        if slot.offset <= offset < slot.end
    ]
    user = schedule.unit_name(module)
    root = schedule.root
    lines = [
        f"shardwise ZeRO-3: while running {user!r}, a parameter was read that is sharded "
        f"(not gathered): one of {names or 'the unit parameters'}.",
        "It was used outside the call of the module that owns it, in a way the engine cannot "
        "see (after the first forward pass, inside another unit).",
    ]
    if names and root is not None:
        shared = _common_ancestor(names[0], user if user != "<root>" else "")
        owner = dict(root.named_modules()).get(shared)
        if shared and owner is not None:
            lines.append(
                f"Put user and owner in one unit: wrap_policy=[{type(owner).__name__!r}], "
                "or call the owning module instead of reading its parameter."
            )
        else:
            lines.append("Call the owning module instead of reading its parameter directly.")
    error.add_note("\n".join(lines))
    error._shardwise_explained = True  # type: ignore[attr-defined]

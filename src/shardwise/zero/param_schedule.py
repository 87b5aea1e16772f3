"""Stage 3: gather each unit's parameters just before they are used, free them right after.

Every call is in one ``Phase``: FORWARD, BACKWARD, or RECOMPUTE (a module's forward run again
inside backward, e.g. by activation checkpointing). The phase comes from the call itself, not
from flags the engine toggles, so forward and backward of different micro-batches may interleave.

Forward. The root, every unit module and every module that holds parameters directly are hooked:
whoever calls a module, its pre-hook gathers the flat buffers it needs (a unit: its own and those
of units whose parameters it shares; any other module: those holding its own parameters). A
unit's pre-hook then prefetches the next unit(s) in the recorded forward order. A buffer is freed
once the last unit that needs it in this pass has run; what is still gathered when the outermost
hooked call returns is freed then. Parameters passed to torch functions outside the call of a
unit that needs them (a tied head ``F.linear(h, self.emb.weight)`` in the root's forward) are
gathered for that use by ``ExternalUses`` (``param_uses``).

Backward. While a forward pass runs, saved-tensor hooks tag every tensor autograd saves with the
unit it was saved in, and with its flat buffer when it is a parameter or a view of one. Backward
reads parameters only through saved tensors, so unpacking is where the buffer is gathered and
waited for: no backward computation can read a buffer whose all_gather has not completed,
whatever the type of a unit's outputs. The first unpack of a unit in a backward gathers all it
needs and prefetches the next unit(s) in backward order. The gradient reducer frees a buffer once
its gradients are reduced; ``finish_backward`` frees the rest. ZeRO paper, section 5.3.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from shardwise.recompute import is_recomputing
from shardwise.zero.flat_param import FlatParam, ParamState
from shardwise.zero.gather_log import GatherLog
from shardwise.zero.param_uses import ExternalUses


class Phase(enum.Enum):
    """What a module call is part of."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"


def call_phase() -> Phase:
    """The phase of a module call: RECOMPUTE inside backward (checkpoint recompute or any forward
    that autograd runs), FORWARD otherwise."""
    if is_recomputing() or torch._C._current_graph_task_id() != -1:
        return Phase.RECOMPUTE
    return Phase.FORWARD


@dataclass(eq=False)
class _Call:
    """A hooked module call in flight (pre-hook ran, forward hook not yet)."""

    module: nn.Module
    phase: Phase
    unit: bool
    needs: list[FlatParam]  # as at the call's start (a need learned during it comes later)


@dataclass(eq=False)
class _Saved:
    """What autograd keeps for one saved tensor of a forward pass."""

    packed: Any  # the tensor, or what saved-tensor hooks outside the pass made of it
    scope: nn.Module  # the unit (or outermost module) whose call saved it
    flat: FlatParam | None  # set when the tensor is a parameter or a view of one
    outer_unpack: Callable[[Any], torch.Tensor] | None


class ParamSchedule:
    """Hooks that move stage-3 flat buffers between sharded and full (see the module doc)."""

    def __init__(
        self,
        modules: list[nn.Module],
        needs: list[list[FlatParam]],
        prefetch: int = 1,
        root: nn.Module | None = None,
    ) -> None:
        self.prefetch = prefetch
        self.order: list[nn.Module] = []  # unit forward order, recorded until the first backward
        self._recording = True
        self._units = {id(m): m for m in modules}
        self._needs: dict[int, list[FlatParam]] = {id(m): list(n) for m, n in zip(modules, needs)}
        self.flats = list(dict.fromkeys(f for n in needs for f in n))
        self._users: dict[FlatParam, int] = {}
        for n in self._needs.values():
            for f in n:
                self._users[f] = self._users.get(f, 0) + 1
        self._done: dict[FlatParam, int] = {}
        self._refs: dict[FlatParam, int] = {f: 0 for f in self.flats}
        self._by_storage = {f.full.untyped_storage()._cdata: f for f in self.flats}
        self.log = GatherLog(self.flats, [_label(f) for f in self.flats])
        for f in self.flats:
            f.log = self.log
        self._open: list[_Call] = []
        self._skipped: dict[int, int] = {}  # calls whose pre-hook found everything held
        self._units_open: list[nn.Module] = []  # FORWARD unit calls, innermost last
        self._saved_hooks: saved_tensors_hooks | None = None
        self._outer: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        self._touched: set[int] = set()
        self._frozen_behind: list[FlatParam] = []  # frozen buffers of the unit backward left
        self.uses = ExternalUses(self)
        hooked = dict(self._units)
        hooked.update(self._direct_modules(root, modules))
        self._hooks = []
        for m in hooked.values():
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward, prepend=True))
            self._hooks.append(m.register_forward_hook(self._post_forward, always_call=True))

    def _direct_modules(
        self, root: nn.Module | None, modules: list[nn.Module]
    ) -> dict[int, nn.Module]:
        """Modules outside the unit list that hold parameters of a flat buffer directly, and the
        root: each needs the buffers of its own parameters, so it works whoever calls it."""
        if root is None:
            return {}
        flat_of = {id(p): f for f in self.flats for p in f.params}
        out: dict[int, nn.Module] = {}
        for m in root.modules():
            if id(m) in self._units:
                continue
            mine = [flat_of[id(p)] for p in m.parameters(recurse=False) if id(p) in flat_of]
            if mine or m is root:
                self._needs[id(m)] = list(dict.fromkeys(mine))
                out[id(m)] = m
        return out

    # ---- gathering and freeing ----

    def needs_of(self, module: nn.Module) -> list[FlatParam]:
        return self._needs[id(module)]

    def _acquire(self, flats: list[FlatParam]) -> None:
        for f in flats:
            self._refs[f] += 1
            f.gather(async_op=True)
        for f in flats:
            f.wait_gather()

    def borrow(self, f: FlatParam) -> None:
        """Gather ``f`` for a use outside its units' calls; held until the pass ends."""
        self._acquire([f])
        self.uses.borrowed.append(f)

    def _prefetch_after(self, module: nn.Module, backward: bool) -> None:
        if self._recording or not self.prefetch or module not in self.order:
            return
        order = self.order[::-1] if backward else self.order
        i = order.index(module)
        for nxt in order[i + 1 : i + 1 + self.prefetch]:
            for f in self._needs[id(nxt)]:
                f.gather(async_op=True)

    def _free_if_idle(self, f: FlatParam) -> None:
        if self._refs[f] == 0:
            f.release()

    # ---- forward hooks ----

    def _held(self, module: nn.Module) -> bool:
        """A module inside a call that already holds all it needs (the common case: a layer
        inside its unit): its hooks have nothing to do."""
        if not self._open or id(module) in self._units:
            return False
        return all(
            self._refs[f] > 0 and f.state is ParamState.FULL for f in self._needs[id(module)]
        )

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._held(module):
            self._skipped[id(module)] = self._skipped.get(id(module), 0) + 1
            return
        phase = call_phase()
        unit = id(module) in self._units
        call = _Call(module, phase, unit, self._needs[id(module)])
        if phase is Phase.RECOMPUTE and unit:
            self._touch(module)  # a recompute starts this unit's backward
        self._acquire(call.needs)
        if phase is Phase.FORWARD:
            if not self._open:
                self._begin_pass()
            if unit:
                self._units_open.append(module)
                if self._recording and module not in self.order:
                    self.order.append(module)
                self._prefetch_after(module, backward=False)
        self._open.append(call)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        skipped = self._skipped.get(id(module), 0)
        if skipped:
            self._skipped[id(module)] = skipped - 1
            return
        while self._open and self._open[-1].module is not module:
            self._open.pop()  # calls whose forward hook never ran (an exception)
        if not self._open:
            return
        call = self._open.pop()
        needs = call.needs
        for f in needs:
            self._refs[f] -= 1
        if call.phase is not Phase.FORWARD:
            return  # inside backward: the reducer and finish_backward free the buffers
        if call.unit:
            self._units_open.pop()
            for f in needs:
                self._done[f] = self._done.get(f, 0) + 1
                if self._done[f] >= self._users[f]:
                    self._done[f] = 0
                    self._free_if_idle(f)
        if not self._open:
            self._end_pass()

    def _begin_pass(self) -> None:
        self._done.clear()
        # saved-tensor hooks the caller installed (activation offload, a checkpoint region
        # around the whole call) still apply: ours wrap theirs
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._saved_hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self.uses.start()

    def _end_pass(self) -> None:
        self.uses.stop()
        self._units_open.clear()  # (empty unless a forward raised)
        for f in self.uses.borrowed:
            self._refs[f] -= 1
        self.uses.borrowed.clear()
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        self._done.clear()
        for f in self.flats:
            self._free_if_idle(f)
        if torch.is_grad_enabled() and not self._recording and self.prefetch and self.order:
            # backward starts with the unit forward ended with: start its gather now, so that
            # it overlaps the loss and the first backward nodes instead of blocking backward
            for f in self._needs[id(self.order[-1])]:
                f.gather(async_op=True)

    def learn_need(self, f: FlatParam) -> None:
        """The innermost open unit used ``f`` without needing it: from now on it does."""
        unit = self._units_open[-1]
        if f not in self._needs[id(unit)]:
            self._needs[id(unit)] = [*self._needs[id(unit)], f]
            self._users[f] += 1

    def innermost_unit(self) -> nn.Module | None:
        return self._units_open[-1] if self._units_open else None

    # ---- backward: saved-tensor hooks ----

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        scope = self._units_open[-1] if self._units_open else self._open[0].module
        flat = self._by_storage.get(tensor.untyped_storage()._cdata)
        if self._outer is None:
            return _Saved(tensor, scope, flat, None)
        return _Saved(self._outer[0](tensor), scope, flat, self._outer[1])

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        self._touch(saved.scope)
        f = saved.flat
        if f is not None and f.state is not ParamState.FULL:
            f.gather()  # waits for an all_gather in flight too
        if saved.outer_unpack is not None:
            return saved.outer_unpack(saved.packed)
        return saved.packed

    def _touch(self, module: nn.Module) -> None:
        """First use of ``module``'s buffers in this backward: gather them and prefetch the
        unit(s) that backward reaches next."""
        if id(module) in self._touched:
            return
        self._touched.add(id(module))
        needs = self._needs[id(module)]
        self._release_frozen_behind(module, needs)
        for f in needs:
            f.gather(async_op=True)
        for f in needs:
            f.wait_gather()
        if id(module) in self._units:
            self._prefetch_after(module, backward=True)

    def _release_frozen_behind(self, module: nn.Module, needs: list[FlatParam]) -> None:
        """Backward reached ``module`` (needing ``needs``): the frozen buffers the unit it left
        needed go back to their shards, unless this unit or one backward reaches later needs
        them (a tied or root unit's; the prefetch would gather them again). Frozen buffers get
        no gradients, so the reducer, which frees a buffer once its gradients are reduced,
        never frees them: kept to the end of backward, a frozen base (LoRA) would be whole on
        every rank by then. An unexpected later use gathers again (``_unpack``)."""
        keep = set(needs)
        if module in self.order:
            later = self.order[: self.order.index(module)]  # backward runs the order reversed
            keep.update(f for unit in later for f in self._needs[id(unit)])
        for f in self._frozen_behind:
            if f not in keep and f.state is ParamState.FULL and self._refs[f] == 0:
                f.release()
        self._frozen_behind = [f for f in needs if not f.trainable]

    def hold(self) -> None:
        """Gather every buffer now and keep it gathered through forward passes and backward
        until ``unhold`` (a pipeline stage that runs many micro-batches per step then gathers
        once per step). Communicates: an all_gather per buffer not yet gathered."""
        self._acquire(self.flats)

    def unhold(self) -> None:
        """End ``hold``: buffers no call is using go back to their shards."""
        for f in self.flats:
            self._refs[f] -= 1
        for f in self.flats:
            self._free_if_idle(f)

    def finish_forward_recording(self) -> None:
        self._recording = False

    def finish_backward(self, flats: list[FlatParam]) -> None:
        """After backward: every buffer back to its shard (none is in use by a forward)."""
        self._touched.clear()
        self._frozen_behind = []
        for f in flats:
            if self._refs.get(f, 0) == 0:
                f.release()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _label(f: FlatParam) -> str:
    """The module path all of a buffer's parameters share (its unit), or ``<root>``."""
    common = f.names[0].split(".")[:-1]
    for name in f.names[1:]:
        path = name.split(".")[:-1]
        k = 0
        while k < min(len(common), len(path)) and common[k] == path[k]:
            k += 1
        common = common[:k]
    return ".".join(common) or "<root>"

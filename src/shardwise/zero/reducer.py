"""Gradient reduction, launched from backward hooks so it overlaps the rest of backward.

Each trainable parameter gets a post-accumulate-grad hook. When every parameter of a flat
buffer has its gradient for this backward, the buffer's reduction starts asynchronously:

- stage 0: all_reduce (average) of the full flat gradients, in place;
- stage 1: reduce_scatter (average) into this rank's slice of the same buffer;
- stages 2-3: reduce_scatter into a temporary slice that is added to the kept ``grad_shard``;
  the full gradient buffer is freed as soon as its reduction completes.

With hierarchical sharding (a flat buffer with a ``replicate`` group) the reduction above runs
within the shard group, then the reduced part (the shard at stages 1-3: 1/dp_shard of the
buffer) is all-reduced (average) across the replicate group, so gradients cross shard groups
(nodes) once, over 1/dp_shard of the bytes (PyTorch HSDP; ZeRO++ section 3.3). That second
reduction also runs asynchronously, as soon as the first one is done, while backward goes on.

Reductions start strictly in buffer order, identical on every rank, so collectives match even if
hooks fire in a different order somewhere. Stages 0-1 only reduce on the last micro-step of an
accumulation window (ZeRO paper, section 5.2); stages 2-3 reduce every micro-step because they do
not keep full gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm import ops
from shardwise.comm.allreduce_rounds import GroupLinks
from shardwise.zero.flat_param import FlatParam
from shardwise.zero.partition import ParamSlot

MAX_IN_FLIGHT = 2  # reductions in flight at stages 2-3: bounds transient gradient memory


@dataclass
class _Pending:
    flat: FlatParam
    handle: ops.Handle
    scratch: torch.Tensor | None  # reduced slice to add into grad_shard
    buf: torch.Tensor  # what was reduced: grad_full, or its copy at the reduce dtype
    crossing: ops.Handle | None = None  # hierarchical sharding: the all_reduce over replicas


class GradReducer:
    """Owns gradient hooks and reductions for ``flats`` (given in launch order)."""

    def __init__(
        self,
        flats: list[FlatParam],
        on_reduced: Callable[[FlatParam], None] | None = None,
        algorithm: str = "native",
        links: Mapping[tuple[int, ...], GroupLinks] | None = None,
    ) -> None:
        self.flats = [f for f in flats if f.trainable]
        self.on_reduced = on_reduced
        # stage 0's all_reduce (comm.algorithms), with each dp group's links by its ranks
        self.algorithm, self.links = algorithm, dict(links or {})
        self._slot: dict[int, tuple[int, int, ParamSlot]] = {}
        self._handles = []
        # The hooks live in each parameter's C++ autograd metadata, where Python's collector
        # cannot see a cycle: a bound method there would keep this reducer, its flat buffers
        # and every parameter alive after the engine is dropped. A weak one does not.
        hook = _weak_hook(self)
        for i, f in enumerate(self.flats):
            for j, (slot, p) in enumerate(zip(f.slots, f.params)):
                self._slot[id(p)] = (i, j, slot)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
        self._reset_pass()
        self._pending: list[_Pending] = []
        self._crossing: list[_Pending] = []  # reduced in the shard group, now across replicas
        self.reduce_now = False
        self.reduce_last = True

    # ---- one backward pass ----

    def _reset_pass(self) -> None:
        self._ready: list[set[str]] = [set() for _ in self.flats]
        self._fresh = [False] * len(self.flats)  # grad_full allocated in this pass (stages 2-3)
        self._next = 0

    def begin(self, reduce_now: bool, last: bool = True) -> None:
        """Called before backward; ``reduce_now`` is False on micro-steps that only accumulate,
        ``last`` is True on the micro-step that ends the accumulation window."""
        self.reduce_now = reduce_now
        self.reduce_last = last
        self._reset_pass()

    def _on_grad(self, p: nn.Parameter) -> None:
        i, j, slot = self._slot[id(p)]
        f = self.flats[i]
        f.used[j] = True
        fresh = f.grad_full is None
        if fresh:  # stages 2-3: allocated when the buffer's first gradient of this pass lands
            f.grad_full = torch.empty(f.padded, dtype=f.dtypes.param, device=f.device)
            f.grad_full[f.numel :].zero_()  # padding
            self._fresh[i] = True
        assert f.grad_full is not None
        view = f.grad_full[slot.offset : slot.end].view(slot.shape)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            # the grad was not written into our buffer: fold it in (the first one of a fresh
            # buffer is a copy, which needs no zeroed buffer)
            if self._fresh[i] and slot.name not in self._ready[i]:
                view.copy_(p.grad)
            else:
                view.add_(p.grad)
        elif self._fresh[i] and slot.name not in self._ready[i]:
            view.zero_()
        p.grad = None if f.stage.shard_grads else view
        self._ready[i].add(slot.name)
        if self.reduce_now:
            self._launch_ready()

    def full_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s gradient accumulated so far in this pass, unreduced: its view in the flat
        gradient buffer, which the reduction will include (zeros if it got none yet). For
        summing a gradient over copies of ``p`` on other ranks before the dp reduction."""
        i, _, slot = self._slot[id(p)]
        f = self.flats[i]
        if f.grad_full is None:
            f.grad_full = torch.zeros(f.padded, dtype=f.dtypes.param, device=f.device)
            self._fresh[i] = True
        view = f.grad_full[slot.offset : slot.end].view(slot.shape)
        if self._fresh[i] and slot.name not in self._ready[i]:
            view.zero_()
        self._ready[i].add(slot.name)
        return view

    def _launch_ready(self) -> None:
        while self._next < len(self.flats) and len(self._ready[self._next]) == len(
            self.flats[self._next].slots
        ):
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        f = self.flats[i]
        if f.grad_full is None:  # no parameter of this buffer got a gradient this pass
            f.grad_full = torch.zeros(f.padded, dtype=f.dtypes.param, device=f.device)
        elif self._fresh[i]:  # parameters without a gradient this pass contribute zeros
            for slot in f.slots:
                if slot.name not in self._ready[i]:
                    f.grad_full[slot.offset : slot.end].zero_()
        # reduce at reduce_dtype (fp32 by default) so small gradients survive the sum
        buf = (
            f.grad_full if f.grad_full.dtype == f.dtypes.reduce else f.grad_full.to(f.dtypes.reduce)
        )
        scratch = None
        if not f.stage.shard_optimizer:
            handle = ops.all_reduce(
                buf,
                "avg",
                group=f.group,
                async_op=True,
                algorithm=self.algorithm,
                links=self.links.get(f.group.ranks),
            )
        elif not f.stage.shard_grads:
            handle = ops.reduce_scatter(
                buf,
                op="avg",
                group=f.group,
                out=buf[f.shard_start : f.shard_stop],
                async_op=True,
            )
        else:
            scratch = torch.empty(
                f.shard_stop - f.shard_start, dtype=f.dtypes.reduce, device=f.device
            )
            handle = ops.reduce_scatter(buf, op="avg", group=f.group, out=scratch, async_op=True)
        self._pending.append(_Pending(f, handle, scratch, buf))
        while f.stage.shard_grads and len(self._pending) > MAX_IN_FLIGHT:
            self._complete(self._pending.pop(0))
        while len(self._crossing) > MAX_IN_FLIGHT:
            self._store(self._crossing.pop(0))

    def _complete(self, item: _Pending) -> None:
        """The shard group's reduction is done: with replicas, start theirs (it runs while
        backward goes on; started in launch order, the same on every rank), else store."""
        item.handle.wait()
        f = item.flat
        if f.replicate is None:
            self._store(item)
            return
        lo, hi = (f.shard_start, f.shard_stop) if f.stage.shard_optimizer else (0, f.padded)
        reduced = item.scratch if item.scratch is not None else item.buf[lo:hi]
        item.crossing = ops.all_reduce(reduced, op="avg", group=f.replicate, async_op=True)
        self._crossing.append(item)

    def _store(self, item: _Pending) -> None:
        """Put a finished reduction where the step reads it."""
        if item.crossing is not None:
            item.crossing.wait()
        f = item.flat
        lo, hi = (f.shard_start, f.shard_stop) if f.stage.shard_optimizer else (0, f.padded)
        if item.scratch is not None:
            if f.grad_shard is None:
                f.grad_shard = item.scratch
            else:
                f.grad_shard.add_(item.scratch)
            f.grad_full = None  # the full gradients of this buffer are no longer needed
            if f.master.device != f.device and self.reduce_last:
                # offload: start the copy to host now, overlapping the rest of backward
                f.grad_host = f.grad_shard.to(f.master.device, non_blocking=True)
        elif item.buf is not f.grad_full:  # reduced in another dtype: store it back
            assert f.grad_full is not None
            f.grad_full[lo:hi].copy_(item.buf[lo:hi])
        if self.on_reduced is not None:
            self.on_reduced(f)

    def finish(self) -> None:
        """After backward: start what has not started (buffers with unused parameters) and
        wait for every reduction."""
        if self.reduce_now:
            while self._next < len(self.flats):
                self._launch(self._next)
                self._next += 1
        while self._pending:
            self._complete(self._pending.pop(0))
        while self._crossing:
            self._store(self._crossing.pop(0))

    def reduce_all(self) -> None:
        """Reduce every buffer now (for gradients accumulated outside an engine backward)."""
        self.reduce_now = True
        self._next = 0
        self.finish()
        self.reduce_now = False
        self._reset_pass()

    def comm_bytes(self) -> int:
        """Bytes of scratch buffers held by reductions in flight."""
        total = 0
        for p in self._pending + self._crossing:
            if p.scratch is not None:
                total += p.scratch.untyped_storage().nbytes()
            if p.buf is not p.flat.grad_full:
                total += p.buf.untyped_storage().nbytes()
        return total

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _weak_hook(reducer: GradReducer) -> Callable[[nn.Parameter], None]:
    """``reducer._on_grad`` through a weak reference (a no-op once the reducer is gone)."""
    ref = weakref.ref(reducer)

    def hook(p: nn.Parameter) -> None:
        r = ref()
        if r is not None:
            r._on_grad(p)

    return hook

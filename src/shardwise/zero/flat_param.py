"""One flat, padded, sharded buffer of parameters and everything ZeRO keeps for it.

A ``FlatParam`` holds a set of parameters laid end to end (see ``partition``). It owns:

- ``full``: the whole flat buffer in the compute dtype; each module parameter's ``.data`` is a
  view into it for the parameter's lifetime. When parameters are sharded (stage 3) its storage
  is resized to zero between uses and refilled by an all_gather: autograd's saved references to
  the parameter views stay valid, since the storage object is the same.
- ``shard``: this rank's slice (a view of ``full`` when parameters are replicated).
- ``master``: what the optimizer updates: this rank's slice (stages 1-3) or all of ``full``
  (stage 0), in fp32; the same memory as the parameters when they are fp32 too.
- ``opt_params``: one ``nn.Parameter`` per parameter piece inside ``master``, the tensors the
  optimizer sees, named after the original parameters.
- gradient buffers: ``grad_full`` (full flat gradients: kept at stages 0-1, transient at 2-3)
  and ``grad_shard`` (the reduced slice kept between micro-steps at stages 2-3).

Hierarchical sharding (HSDP; ZeRO++ hpZ, MiCS): ``group`` is a shard group and ``replicate``
the group of ranks holding the same shard in the other shard groups (None when there are none).
Everything is sharded and gathered within ``group``; only gradient reductions, the initial
broadcast and the step's used map also run over ``replicate``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm import ops
from shardwise.comm.groups import Group
from shardwise.zero.gather_log import GatherLog
from shardwise.zero.partition import (
    ParamSlot,
    ShardPiece,
    layout,
    padded_numel,
    pieces_in,
    shard_range,
)
from shardwise.zero.sharded_param import make_sharded
from shardwise.zero.stage import ZeroStage


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only the shard exists; full storage is empty
    GATHERING = "gathering"  # an all_gather into full is in flight
    FULL = "full"  # full holds every parameter


_LEGAL = {
    ParamState.SHARDED: {ParamState.GATHERING, ParamState.FULL},
    ParamState.GATHERING: {ParamState.FULL},
    ParamState.FULL: {ParamState.SHARDED},
}


@dataclass(frozen=True)
class Dtypes:
    """Dtypes of one training run: parameters/activations, gradient reduction, master copy."""

    param: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    master: torch.dtype = torch.float32


def _resize_storage(t: torch.Tensor, numel: int) -> None:
    storage = t.untyped_storage()
    nbytes = numel * t.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)
    if numel and t.numel() != numel:  # made by ``_unallocated``: its shape comes with storage
        t.set_(storage, 0, (numel,), (1,))


def _unallocated(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty 1-D tensor whose storage holds nothing yet (gathered into later:
    ``_resize_storage`` gives it its storage and shape together). Never allocated at its full
    size, not even untouched: address space counts against a process's data limit."""
    return torch.empty(0, dtype=dtype, device=device)


def make_real(p: nn.Parameter, device: torch.device) -> None:
    """Move a meta parameter to ``device`` in place (the same Python object, so references to
    it, an optimizer's included, stay valid): it holds one element expanded to its shape
    until its ``.data`` is pointed at real values. ``.data`` cannot cross from meta to a real
    device, so the two tensors' contents are swapped instead."""
    placeholder = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
    torch.utils.swap_tensors(p, nn.Parameter(placeholder, requires_grad=p.requires_grad))


class FlatParam:
    """A unit's (or a bucket's) parameters, flattened, padded and sharded over ``group`` (and
    replicated over ``replicate``, hierarchical sharding)."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        group: Group,
        stage: ZeroStage,
        dtypes: Dtypes,
        trainable: bool = True,
        replicate: Group | None = None,
        deferred: torch.device | None = None,
    ) -> None:
        if not named_params:
            raise ValueError("a FlatParam needs at least one parameter")
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group, self.stage, self.dtypes, self.trainable = group, stage, dtypes, trainable
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        # deferred (parameters on the meta device): nothing to copy, and at stage 3 the full
        # buffer is never allocated: only the shard is, filled later by ``write_range``
        self.deferred = deferred is not None
        self.device = deferred if deferred is not None else self.params[0].device
        for p in self.params:
            if p.is_meta and deferred is not None:
                make_real(p, deferred)
        self.slots, self.numel = layout(self.names, [tuple(p.shape) for p in self.params])
        n = group.size
        self.padded = padded_numel(self.numel, n)
        self.shard_start, self.shard_stop = shard_range(self.padded, n, group.rank)
        if stage.shard_optimizer:
            self.opt_start, self.opt_stop = self.shard_start, self.shard_stop
        else:
            self.opt_start, self.opt_stop = 0, self.padded
        if self.deferred and stage.shard_params:
            self.full = _unallocated(dtypes.param, self.device)
        else:
            self.full = torch.zeros(self.padded, dtype=dtypes.param, device=self.device)
        # The initial weights at full precision: the master copy starts from these, not from
        # their rounding to the compute dtype.
        self._init_master: torch.Tensor | None = None
        if dtypes.master != dtypes.param and trainable and not self.deferred:
            self._init_master = torch.zeros(self.padded, dtype=dtypes.master, device=self.device)
        with torch.no_grad():
            for slot, p in zip(self.slots, self.params if not self.deferred else []):
                src = p.detach().reshape(-1)
                self.full[slot.offset : slot.end].copy_(src)
                if self._init_master is not None:
                    self._init_master[slot.offset : slot.end].copy_(src)
        if not (self.deferred and stage.shard_params):  # else no values until the shard is filled
            self._attach_views()
        # What a released parameter's ``.data`` shows: its shape, NaN values (zero for integer
        # dtypes), backed by one element, never freed memory; reading it raises first (a
        # stage-3 parameter is a ``ShardedParameter``), the NaN is a second line of defence.
        fill = float("nan") if dtypes.param.is_floating_point else 0
        self._placeholder = torch.full((), fill, dtype=dtypes.param, device=self.device)
        self.state = ParamState.FULL
        self.master: torch.Tensor
        self._gather_handle: ops.Handle | None = None
        self.log: GatherLog | None = None  # stage 3: records every all_gather it starts
        self._gather_src: torch.Tensor | None = None
        if self.deferred and stage.shard_params:  # made by finish_init
            self.shard = self.master = torch.empty(0, dtype=dtypes.param, device=self.device)
        else:
            self.shard = self.full[self.shard_start : self.shard_stop]
            self.master = self.full[self.opt_start : self.opt_stop]
        self.opt_pieces: list[ShardPiece] = []
        self.opt_params: list[nn.Parameter] = []
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.grad_host: torch.Tensor | None = None  # offload: grad_shard's copy in host memory
        # which parameters got a gradient on this rank since the last step (see zero.step)
        self.used = [False] * len(self.params)

    # ---- set-up after rank 0's weights were broadcast into ``full`` ----

    def reduce_groups(self) -> list[Group]:
        """The groups a reduction over every data-parallel rank runs over, in order: the shard
        group, then (hierarchical sharding) the replicate group."""
        return [self.group] if self.replicate is None else [self.group, self.replicate]

    def broadcast_from(self, src: int) -> None:
        """Give every rank ``src``'s initial weights (hierarchical sharding: first across the
        replicate group from its first rank, then from ``src`` in the shard group, so every
        rank ends with the first replica's). Communicates: a broadcast of the flat buffer per
        group, at the master dtype when it differs from the compute dtype, else at the compute
        dtype."""
        value = self._init_master if self._init_master is not None else self.full
        if self.replicate is not None:
            ops.broadcast(value, src=self.replicate.ranks[0], group=self.replicate)
        ops.broadcast(value, src=src, group=self.group)
        if self._init_master is not None:
            with torch.no_grad():
                self.full.copy_(self._init_master)

    def finish_init(self, host: torch.device | None = None) -> None:
        """Split off the shard, the fp32 master and the optimizer's views; release what this
        stage does not keep. ``host``: where the master and optimizer live (offload)."""
        if self.stage.shard_params:
            if self.deferred:  # the values come later, written into the shard only
                self.shard = torch.zeros(
                    self.shard_stop - self.shard_start, dtype=self.dtypes.param, device=self.device
                )
            else:
                self.shard = self.full[self.shard_start : self.shard_stop].clone()
            self._transition(ParamState.SHARDED)
            _resize_storage(self.full, 0)
            self._detach_views()
            for name, p in zip(self.names, self.params):
                make_sharded(p, name, self)
        base = self.shard if self.stage.shard_optimizer else self.full
        host = host or self.device
        if self._init_master is not None:
            init = self._init_master[self.opt_start : self.opt_stop]
            self.master = init.to(host, copy=True)
            self._init_master = None
        elif self.deferred and self.trainable and self.dtypes.master != self.dtypes.param:
            self.master = torch.zeros(
                self.opt_stop - self.opt_start, dtype=self.dtypes.master, device=host
            )
        elif host != self.device and self.trainable:
            self.master = base.detach().to(host, copy=True)
        else:
            self.master = base
        if host.type == "cpu" and self.device.type == "cuda":
            self.master = self.master.pin_memory()
        if not self.trainable:
            return
        self.opt_pieces = pieces_in(self.slots, self.opt_start, self.opt_stop)
        self.opt_params = [
            nn.Parameter(self.master[pc.shard_start : pc.shard_start + pc.numel])
            for pc in self.opt_pieces
        ]
        if not self.stage.shard_grads:
            self.grad_full = torch.zeros(self.padded, dtype=self.dtypes.param, device=self.device)
            for slot, p in zip(self.slots, self.params):
                p.grad = self.grad_full[slot.offset : slot.end].view(slot.shape)

    # ---- parameter lifecycle (stage 3) ----

    @property
    def holds_values(self) -> bool:
        """True while ``full`` holds every parameter (each parameter's ``.data`` is its view)."""
        return self.state is ParamState.FULL

    def _transition(self, new: ParamState) -> None:
        assert new in _LEGAL[self.state], f"illegal {self.state} -> {new}"
        self.state = new

    def _attach_views(self) -> None:
        """Each parameter's ``.data`` becomes its view of ``full``."""
        for slot, p in zip(self.slots, self.params):
            p.data = self.full[slot.offset : slot.end].view(slot.shape)

    def _detach_views(self) -> None:
        """``full`` is freed: point each parameter at the placeholder, never at freed memory
        (autograd's saved views of ``full`` stay valid: the storage object is the same)."""
        for slot, p in zip(self.slots, self.params):
            p.data = self._placeholder.expand(slot.shape)

    def gather(self, async_op: bool = False) -> None:
        """Refill ``full`` from every rank's shard. Communicates: all_gather of the padded
        flat buffer (payload ``padded * itemsize`` bytes)."""
        if self.state is not ParamState.SHARDED:
            if not async_op:
                self.wait_gather()
            return
        if self.log is not None:
            self.log.record(self)
        _resize_storage(self.full, self.padded)
        self._gather_src = self.shard
        self._gather_handle = ops.all_gather(
            self.shard, group=self.group, out=self.full, async_op=True
        )
        self._transition(ParamState.GATHERING)
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        if self.state is ParamState.GATHERING:
            assert self._gather_handle is not None
            self._gather_handle.wait()
            self._gather_handle = self._gather_src = None
            self._transition(ParamState.FULL)
            self._attach_views()

    def release(self) -> None:
        """Free the full parameters (stage 3 only); the shard stays."""
        if not self.stage.shard_params or self.state is ParamState.SHARDED:
            return
        self.wait_gather()
        self._transition(ParamState.SHARDED)
        _resize_storage(self.full, 0)
        self._detach_views()

    # ---- after the optimizer step ----

    def publish_master(self) -> ops.Handle | None:
        """Copy the updated master into the parameters; at stages 1-2 start the all_gather that
        brings every rank the others' updated slices. Communicates (stages 1-2): all_gather of
        the padded flat buffer."""
        if self.stage.shard_params:
            self.release()  # a gathered copy would hold the parameters from before the step
        target = self.shard if self.stage.shard_optimizer else self.full
        if target.data_ptr() != self.master.data_ptr():
            with torch.no_grad():
                target.copy_(self.master, non_blocking=True)
        if not self.stage.gather_after_step:
            return None
        return ops.all_gather(self.shard, group=self.group, out=self.full, async_op=True)

    # ---- checkpoints and state dicts ----

    def optimizer_grad(self) -> torch.Tensor:
        """The reduced gradients of the optimizer's range, at the master dtype and on the
        master's device (a view when no conversion is needed)."""
        if self.grad_host is not None:  # offload: copied to host when its reduction finished
            host, self.grad_host = self.grad_host, None
            return host.to(dtype=self.master.dtype)
        src: torch.Tensor | None
        if self.stage.shard_grads:
            src = self.grad_shard
            if src is None:  # no backward reached this buffer: zero gradients
                src = torch.zeros(
                    self.opt_stop - self.opt_start, dtype=self.dtypes.reduce, device=self.device
                )
        else:
            assert self.grad_full is not None
            src = self.grad_full[self.opt_start : self.opt_stop]
        return src.to(device=self.master.device, dtype=self.master.dtype)

    def full_master(self) -> torch.Tensor:
        """Every parameter of this buffer at master precision, padded flat. Communicates
        (optimizer sharded): all_gather of the master slices."""
        if not self.stage.shard_optimizer:
            return self.master.detach().clone()
        src = self.master.to(self.device)
        out = torch.empty(self.padded, dtype=src.dtype, device=self.device)
        ops.all_gather(src.contiguous(), group=self.group, out=out)
        return out

    def load_param(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Write one whole parameter's value into every copy this rank keeps of it."""
        self.write_range(slot, 0, value.detach().reshape(-1))

    def kept_range(self, slot: ParamSlot) -> tuple[int, int]:
        """The part ``[start, stop)`` of the flattened parameter of ``slot`` that this rank keeps
        in some copy (the whole parameter while ``full`` is allocated; else what falls in the
        shard and optimizer ranges); ``start == stop`` when it keeps none."""
        if self.full.untyped_storage().size() > 0:
            return 0, slot.numel
        lo = max(slot.offset, min(self.shard_start, self.opt_start))
        hi = min(slot.end, max(self.shard_stop, self.opt_stop))
        return (lo - slot.offset, hi - slot.offset) if lo < hi else (0, 0)

    def write_range(self, slot: ParamSlot, start: int, flat: torch.Tensor) -> None:
        """Write elements ``[start, start + len(flat))`` of the flattened parameter of ``slot``
        into every copy this rank keeps of them (dtype converted on copy)."""
        lo_abs = slot.offset + start
        hi_abs = lo_abs + flat.numel()
        assert slot.offset <= lo_abs <= hi_abs <= slot.end, "range outside the parameter"
        with torch.no_grad():
            if self.full.untyped_storage().size() > 0:
                self.full[lo_abs:hi_abs].copy_(flat)
            for begin, stop, target in (
                (self.shard_start, self.shard_stop, self.shard),
                (self.opt_start, self.opt_stop, self.master),
            ):
                lo, hi = max(lo_abs, begin), min(hi_abs, stop)
                if lo < hi:
                    target[lo - begin : hi - begin].copy_(flat[lo - lo_abs : hi - lo_abs])

    def memory(self) -> dict[str, int]:
        """Bytes held now, counted from the tensors that exist (storage sizes)."""

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()

        params = nbytes(self.full)
        if self.shard.untyped_storage().data_ptr() != self.full.untyped_storage().data_ptr():
            params += nbytes(self.shard)
        grads = nbytes(self.grad_full) + nbytes(self.grad_shard) + nbytes(self.grad_host)
        master = 0
        if self.master.untyped_storage().data_ptr() not in (
            self.full.untyped_storage().data_ptr(),
            self.shard.untyped_storage().data_ptr(),
        ):
            master = nbytes(self.master)
        return {"params": params, "grads": grads, "master": master}

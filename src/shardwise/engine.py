"""The training engine: composes ZeRO sharding, precision, recompute and the optimizer.

engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              shardwise.Config(zero_stage=2))
loss = engine(x, y)
engine.backward(loss)
engine.step()
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shardwise import comm
from shardwise.comm.groups import Group
from shardwise.config import Config
from shardwise.mesh import Mesh
from shardwise.precision import DynamicLossScaler, resolve_precision
from shardwise.recompute import apply_activation_checkpointing
from shardwise.zero import optimizer as zero_opt
from shardwise.zero.flat_param import Dtypes, FlatParam
from shardwise.zero.param_schedule import ParamSchedule
from shardwise.zero.partition import ParamSlot
from shardwise.zero.reducer import GradReducer
from shardwise.zero.stage import ZeroStage
from shardwise.zero.step import sharded_step, zero_grads
from shardwise.zero.units import buckets, split_trainable, units

log = logging.getLogger("shardwise")

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def _resolve_group(group: Group | Mesh | None) -> Group:
    if isinstance(group, Mesh):
        return group.group("dp")
    return comm.resolve(group)


def _check_model(model: nn.Module) -> torch.device:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if not devices:
        raise ValueError("the model has no parameters to train")
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters and buffers are on different devices "
            f"{sorted(str(d) for d in devices)}; move it to one device first"
        )
    return devices.pop()


class Engine:
    """A model, its sharded optimizer and the ZeRO machinery, driven by forward / backward /
    step. Build it with ``shardwise.initialize``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: zero_opt.OptimizerLike,
        config: Config,
        group: Group | Mesh | None = None,
        lr_scheduler: SchedulerFactory | None = None,
    ) -> None:
        self.config = config
        self.device = _check_model(model)
        self.group = _resolve_group(group)
        self.stage = ZeroStage.of(config.zero_stage)
        comm.set_debug(True if config.debug_collectives else None)
        policy = resolve_precision(config.precision, config.reduce_dtype, self.device)
        self.precision = policy
        self.dtypes = Dtypes(policy.compute_dtype, policy.reduce_dtype, policy.master_dtype)
        self.host = torch.device("cpu") if config.offload_optimizer else self.device
        self.module = model
        if config.activation_checkpointing:
            apply_activation_checkpointing(model, config.activation_checkpointing)
        self._seed(config.seed)
        src = self.group.ranks[0]
        self._broadcast_buffers(src)
        self.flats, self._schedule = self._build_flats(model, src)
        self._where: dict[int, tuple[FlatParam, ParamSlot]] = {
            id(p): (f, s) for f in self.flats for s, p in zip(f.slots, f.params)
        }
        self._cast_frozen_and_buffers()
        if self.dtypes.param != torch.float32:  # floating inputs follow the compute dtype
            self._input_hook = model.register_forward_pre_hook(self._cast_inputs)
        self.optimizer = self._build_optimizer(model, optimizer)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.scaler = DynamicLossScaler(
            init_scale=2.0**config.initial_loss_scale_power,
            growth_interval=config.loss_scale_window,
            min_scale=config.min_loss_scale,
            enabled=policy.needs_loss_scaling,
        )
        on_reduced = (lambda f: f.release()) if self.stage.shard_params else None
        self.reducer = GradReducer(self.flats, on_reduced=on_reduced)
        self.global_step = 0
        self.micro_step = 0
        self.grad_norm: float | None = None
        self.skipped_steps = 0

    # ---- construction ----

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _broadcast_buffers(self, src: int) -> None:
        """Every rank starts from rank 0's buffers (e.g. BatchNorm running statistics)."""
        bufs = [b for b in self.module.buffers() if b.numel() > 0]
        for b in bufs:
            comm.broadcast(
                b.data if b.is_contiguous() else b.data.contiguous(), src=src, group=self.group
            )

    def _build_flats(
        self, model: nn.Module, src: int
    ) -> tuple[list[FlatParam], ParamSchedule | None]:
        cfg, stage = self.config, self.stage
        if not stage.shard_params:
            flats = [
                FlatParam(named, self.group, stage, self.dtypes, trainable)
                for named, trainable in buckets(model, cfg.reduce_bucket_bytes)
            ]
            frozen = [p for p in model.parameters() if not p.requires_grad]
            for p in frozen:  # replicated and never updated: rank 0's values, once
                comm.broadcast(p.data, src=src, group=self.group)
            schedule = None
        else:
            specs = units(model, tuple(cfg.wrap_policy) if cfg.wrap_policy else None)
            by_name: dict[str, list[FlatParam]] = {}
            flats = []
            for spec in specs:
                trainable, frozen = split_trainable(spec.own)
                mine = [
                    FlatParam(named, self.group, stage, self.dtypes, flag)
                    for named, flag in ((trainable, True), (frozen, False))
                    if named
                ]
                by_name[spec.name] = mine
                flats += mine
            needs = [by_name[s.name] + [f for n in s.foreign for f in by_name[n]] for s in specs]
            # reductions start in reverse registration order: roughly the backward order
            flats = flats[::-1]
            schedule = ParamSchedule([s.module for s in specs], needs, cfg.prefetch_units)
        for f in flats:
            f.broadcast_from(src)
            f.finish_init(self.host)
        return flats, schedule

    def _cast_frozen_and_buffers(self) -> None:
        """Parameters outside flat buffers (frozen, stages 0-2) and floating buffers run in the
        compute dtype too."""
        if self.dtypes.param == torch.float32:
            return
        for p in self.module.parameters():
            if id(p) not in self._where and p.is_floating_point():
                p.data = p.data.to(self.dtypes.param)
        for mod in self.module.modules():
            for name, b in mod.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    setattr(mod, name, b.to(self.dtypes.param))

    def _cast_inputs(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            a.to(self.dtypes.param) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        )

    def _build_optimizer(
        self, model: nn.Module, optimizer: zero_opt.OptimizerLike
    ) -> torch.optim.Optimizer:
        shard_of = {}
        for f in self.flats:
            for pc, op in zip(f.opt_pieces, f.opt_params):
                shard_of[id(f.params[f.slots.index(pc.slot)])] = op
        return zero_opt.rebuild(
            optimizer, list(model.parameters()), shard_of, self.config.allow_untested_optimizer
        )

    def _build_scheduler(self, factory: SchedulerFactory | None) -> Any:
        if factory is None:
            return None
        if isinstance(factory, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(
                "pass lr_scheduler as a callable optimizer -> scheduler (e.g. "
                "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)): the engine "
                "builds its own optimizer over the shards"
            )
        return factory(self.optimizer)

    # ---- training ----

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def is_boundary(self) -> bool:
        """True when the next backward ends an accumulation window."""
        return (self.micro_step + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` / accumulation steps (times the loss scale in fp16), with
        gradient reduction overlapped. Communicates: see ``GradReducer``."""
        if loss.dim() != 0:
            raise ValueError(f"backward needs a scalar loss, got shape {tuple(loss.shape)}")
        if self._schedule is not None:
            self._schedule.finish_forward_recording()
        self.reducer.begin(
            self.is_boundary or self.stage.reduce_every_micro_step, last=self.is_boundary
        )
        scaled = self.scaler.scale_loss(loss.float() / self.config.gradient_accumulation_steps)
        try:
            scaled.backward()
        finally:
            self.reducer.finish()
            if self._schedule is not None:
                self._schedule.finish_backward(self.flats)
        self.micro_step += 1

    def step(self) -> bool:
        """Optimizer step at the end of an accumulation window (a no-op otherwise).

        Clips to ``gradient_clipping``, skips the step on fp16 overflow (on every rank), steps
        the learning-rate scheduler, publishes the new parameters (stages 1-2 all_gather them).
        Returns True if the parameters were updated. Communicates: see ``zero.step``.
        """
        accum = self.config.gradient_accumulation_steps
        if self.micro_step == 0 or self.micro_step % accum != 0:
            return False
        result = sharded_step(
            self.flats, self.optimizer, self.scaler, self.config.gradient_clipping
        )
        self.grad_norm = result.grad_norm
        if result.updated:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_step += 1
        else:
            self.skipped_steps += 1
            log.warning(
                "rank %d: step %d skipped: gradient overflow; loss scale now %g",
                self.group.ranks[self.group.rank],
                self.global_step,
                self.scaler.scale,
            )
        self.zero_grad()
        return result.updated

    def zero_grad(self) -> None:
        """Drop accumulated gradients (kept gradient buffers are zeroed in place)."""
        zero_grads(self.flats)

    # ---- state ----

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state keyed by the original names, parameters at master
        precision. Communicates (stages 1-3): an all_gather per flat buffer."""
        values: dict[int, torch.Tensor] = {}
        for f in self.flats:
            full = f.full_master()
            for slot, p in zip(f.slots, f.params):
                values[id(p)] = full[slot.offset : slot.end].view(slot.shape).clone()
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            v = values.get(id(t))
            out[name] = v if v is not None else t.detach().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full model state (as ``state_dict`` returns); communicates nothing."""
        own = self.module.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"state dict does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, t in own.items():
            value = state[name]
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(
                    f"state dict entry {name} has shape {tuple(value.shape)}, the "
                    f"model's is {tuple(t.shape)}"
                )
            where = self._where.get(id(t))
            if where is not None:
                where[0].load_param(where[1], value.to(self.device))
            else:
                with torch.no_grad():
                    t.data.copy_(value)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, from the tensors that exist: params, grads, optimizer
        (states and a separate fp32 master), buffers, comm (buffers of collectives in flight);
        plus ``device`` and ``host`` totals."""
        params = grads = master = master_host = 0
        for f in self.flats:
            m = f.memory()
            params += m["params"]
            grads += m["grads"]
            master += m["master"]
            if f.master.device.type == "cpu" and self.device.type != "cpu":
                master_host += m["master"]
        outside = set(self._where)
        for p in self.module.parameters():
            if id(p) not in outside:
                params += p.untyped_storage().nbytes()
        states = zero_opt.state_bytes(self.optimizer)
        opt_host = states if self.host.type == "cpu" and self.device.type != "cpu" else 0
        buffers = sum(b.untyped_storage().nbytes() for b in self.module.buffers())
        out = {
            "params": params,
            "grads": grads,
            "optimizer": states + master,
            "buffers": buffers,
            "comm": self.reducer.comm_bytes(),
        }
        out["host"] = opt_host + master_host
        out["device"] = (
            sum(out[k] for k in ("params", "grads", "optimizer", "buffers", "comm")) - out["host"]
        )
        return out

    # ---- checkpoints (see shardwise.checkpoint.engine_state) ----
    #
    # The training loop drives them; step() never saves by itself:
    #
    #     engine.resume(sampler=sampler)           # resume="auto": newest valid checkpoint
    #     while engine.global_step < steps:
    #         ...forward / backward...
    #         if engine.step():
    #             engine.maybe_save(sampler=sampler)  # every config.checkpoint_every steps
    #     engine.wait_for_checkpoint()              # async saves: before the process exits

    _ckpt_writer: Any = None  # AsyncCheckpointWriter, made on the first async save
    _last_saved_step: int | None = None

    def _checkpoint_root(self, path: str | Path | None) -> Path:
        root = path if path is not None else self.config.checkpoint_dir
        if root is None:
            raise ValueError(
                "no checkpoint directory: pass path= or set Config(checkpoint_dir=...)"
            )
        return Path(root)

    def save(
        self,
        path: str | Path | None = None,
        *,
        sampler: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Save a sharded checkpoint of step ``global_step``; call on every rank.

        Args:
            path: checkpoint root (default ``config.checkpoint_dir``).
            sampler: a data sampler whose position is saved (``state_dict()``).
            extra: JSON-able values returned by ``load`` under "extra".

        With ``config.async_save`` the state is copied to host memory and written by a
        background thread while training goes on (the first async save forms the writer's
        process group: every rank must make it together); ``wait_for_checkpoint()`` blocks
        until it is committed. Returns the checkpoint's path. Communicates: see
        ``shardwise.checkpoint.engine_state.save_engine``.
        """
        from shardwise.checkpoint import AsyncCheckpointWriter
        from shardwise.checkpoint.engine_state import save_engine

        root = self._checkpoint_root(path)
        writer = None
        if self.config.async_save:
            if self._ckpt_writer is None or self._ckpt_writer.root != root:
                self.wait_for_checkpoint()
                self._ckpt_writer = AsyncCheckpointWriter(root, keep_last=self.config.keep_last)
            writer = self._ckpt_writer
        out = save_engine(self, root, sampler=sampler, extra=extra, async_writer=writer)
        self._last_saved_step = self.global_step
        return out

    def maybe_save(self, *, sampler: Any = None) -> Path | None:
        """Save when ``global_step`` is a positive multiple of ``config.checkpoint_every`` and
        was not saved yet (call it after every ``step()``, on every rank); else do nothing.
        Returns the checkpoint's path, or None."""
        every = self.config.checkpoint_every
        step = self.global_step
        if not every or step == 0 or step % every or step == self._last_saved_step:
            return None
        return self.save(sampler=sampler)

    def load(self, path: str | Path = "latest", *, sampler: Any = None) -> dict[str, Any]:
        """Load a checkpoint into this engine (any world size, stage or precision may have
        written it); call on every rank. ``path``: ``"latest"`` (newest committed in
        ``config.checkpoint_dir``), a checkpoint root, or a ``step-N`` directory. Verifies every
        file first and raises ``CheckpointError`` naming a damaged one. Returns the trainer
        state. Communicates: see ``shardwise.checkpoint.engine_state.load_engine``."""
        from shardwise.checkpoint.engine_state import load_engine

        self.wait_for_checkpoint()
        root = self._checkpoint_root(None if path == "latest" else path)
        state = load_engine(self, root, sampler=sampler)
        self._last_saved_step = self.global_step
        return state

    def resume(self, *, sampler: Any = None) -> dict[str, Any] | None:
        """``config.resume == "auto"``: load the newest checkpoint in ``config.checkpoint_dir``
        that verifies, skipping damaged ones with a warning that names each and why; no
        checkpoint: log it and start fresh. ``"never"``: do nothing. Call on every rank before
        training. Returns the trainer state, or None when nothing was loaded."""
        from shardwise.checkpoint.engine_state import resume_engine

        if self.config.resume != "auto":
            return None
        state = resume_engine(self, self._checkpoint_root(None), sampler=sampler)
        if state is not None:
            self._last_saved_step = self.global_step
        return state

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the pending background save is committed (raising its error); returns
        the last committed path of the async writer (None if it never saved)."""
        if self._ckpt_writer is None:
            return None
        return self._ckpt_writer.wait()

    def load_full_state(self, path_or_state_dict: str | Path | dict[str, torch.Tensor]) -> None:
        """Start from full model weights: a state dict, a ``.safetensors`` file (e.g. from
        ``shardwise checkpoint export``), a ``torch.save`` file or a checkpoint directory; call
        on every rank right after ``initialize``. Optimizer states are untouched (empty).
        Communicates nothing."""
        from shardwise.checkpoint.engine_state import load_pretrained

        load_pretrained(self, path_or_state_dict)


def initialize(
    model: nn.Module,
    optimizer: zero_opt.OptimizerLike,
    config: Config | dict[str, Any] | None = None,
    *,
    group: Group | Mesh | None = None,
    lr_scheduler: SchedulerFactory | None = None,
) -> Engine:
    """Wrap ``model`` for ZeRO training over ``group`` (default: the world; a Mesh: its dp axis).

    Args:
        model: the model, on one device, identical in structure on every rank (weights are
            taken from the group's first rank).
        optimizer: a torch optimizer over ``model.parameters()`` (its class, hyperparameters
            and parameter groups are kept) or a callable ``params -> optimizer``.
        config: a ``Config`` or a dict of its keys.
        lr_scheduler: a callable ``optimizer -> scheduler``, stepped with the optimizer.

    Communicates: broadcasts of every parameter and buffer from the group's first rank.
    """
    from shardwise import dist as sw_dist

    if not sw_dist.is_initialized():
        sw_dist.init()
    if config is None:
        config = Config()
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a shardwise.Config or a dict, got {type(config).__name__}")
    return Engine(model, optimizer, config, group=group, lr_scheduler=lr_scheduler)

"""The training engine: composes ZeRO sharding, precision, recompute and the optimizer.

engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              shardwise.Config(zero_stage=2))
loss = engine(x, y)
engine.backward(loss)
engine.step()
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise import deferred
from shardwise.comm.groups import Group
from shardwise.config import Config
from shardwise.deferred.init import init_plan
from shardwise.deferred.peak import InitPeak
from shardwise.engine import materialize, param_access
from shardwise.engine.build import (
    SchedulerFactory,
    backward_args,
    broadcast_buffers,
    build_flats,
    build_optimizer,
    build_scheduler,
    cast_outside_flats,
    check_model,
    check_same_structure,
    resolve_dp,
    resolve_group,
    resolve_replicate,
)
from shardwise.engine.checkpoint_methods import CheckpointMethods
from shardwise.engine.memory import KINDS, memory_report
from shardwise.engine.placements import EnginePlacements, ExtraStyles
from shardwise.engine.run_state import CheckpointState, Steps
from shardwise.mesh import AXIS_ORDER, Axis, Mesh
from shardwise.parallel.placement import Placement, StageOwned
from shardwise.precision import DynamicLossScaler, resolve_precision
from shardwise.topology import discover
from shardwise.zero import optimizer as zero_opt
from shardwise.zero.flat_param import Dtypes, FlatParam
from shardwise.zero.partition import ParamSlot
from shardwise.zero.reducer import GradReducer
from shardwise.zero.stage import ZeroStage
from shardwise.zero.step import sharded_step, zero_grads

log = logging.getLogger("shardwise")

__all__ = ["Engine", "SchedulerFactory"]


class Engine(CheckpointMethods):
    """A model, its sharded optimizer and the ZeRO machinery, driven by forward / backward /
    step. Build it with ``shardwise.initialize``, which applies the parallelisms that change the
    model first (activation checkpointing from ``Config``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: zero_opt.OptimizerLike,
        config: Config,
        group: Group | Mesh,
        lr_scheduler: SchedulerFactory | None = None,
        placements: Mapping[str, Placement] | None = None,
        init_fn: deferred.InitFn | None = None,
    ) -> None:
        self.config = config
        self.device = check_model(model)
        param_access.check_unclaimed(model)  # a model is initialized once: say so first
        # a model built on the meta device: this rank allocates only what it keeps, and
        # ``materialize.fill_engine`` fills it (``shardwise.initialize`` calls it)
        self.deferred = self.device.type == "meta"
        if self.deferred:
            self.device = deferred.target_device()
        self.init_peak = InitPeak()
        eager_bytes = 0 if self.deferred else sum(p.nbytes for p in model.parameters())
        self.mesh = group if isinstance(group, Mesh) else None
        self.group = resolve_group(group)  # ZeRO shards over it (a parameter's own: see below)
        self.replicate = resolve_replicate(group)  # hierarchical sharding: copies of the shards
        self.dp_group = resolve_dp(group)  # every data-parallel rank
        if config.debug_collectives:  # this engine's collectives only; nothing process-wide
            self.group = self.group.with_debug(True)
            self.dp_group = self.dp_group.with_debug(True)
            if self.replicate is not None:
                self.replicate = self.replicate.with_debug(True)
        # where every parameter lives: the plan's placements, completed and checked, and the
        # dp group ZeRO shards each over (``self.group`` unless it is split along a dp axis)
        self.placements = EnginePlacements(
            model, self.mesh, placements, self._extra_styles(model), self.group
        )
        self.stage = ZeroStage.of(config.zero_stage)
        if isinstance(optimizer, torch.optim.Optimizer):  # before the model is rebuilt
            zero_opt.check_shardable(type(optimizer), config.allow_untested_optimizer)
        policy = resolve_precision(config.precision, config.reduce_dtype, self.device)
        self.precision = policy
        self.dtypes = Dtypes(policy.compute_dtype, policy.reduce_dtype, policy.master_dtype)
        self.host = torch.device("cpu") if config.offload_optimizer else self.device
        self.module = model
        check_same_structure(model, self.dp_group, self.device)
        if self.deferred:
            materialize.prepare(model, init_plan(model, init_fn), self.device)
        broadcast_buffers(model, self.dp_group.ranks[0], self.dp_group)
        self.flats, self._schedule = build_flats(
            model,
            config,
            self.stage,
            self.group,
            self.dtypes,
            self.host,
            self.replicate,
            deferred=self.device if self.deferred else None,
            group_of=self.placements.zero_group,
        )
        self._where: dict[int, tuple[FlatParam, ParamSlot]] = {
            id(p): (f, s) for f in self.flats for s, p in zip(f.slots, f.params)
        }
        if self.deferred:  # before the claim: a claimed (weakly referenced) tensor can't swap
            materialize.outside_flats(model, set(self._where), self.device)
        param_access.claim(model)
        self.norm = self.placements.norm_reduction(model)
        self._state_dict_hooks = param_access.guard_state_dict(model, self.flats)
        cast_outside_flats(model, set(self._where), self.dtypes.param)
        if self.dtypes.param != torch.float32:  # floating inputs follow the compute dtype
            self._input_hook = model.register_forward_pre_hook(self._cast_inputs)
        self.optimizer = build_optimizer(model, self.flats, optimizer, config)
        self.lr_scheduler = build_scheduler(lr_scheduler, self.optimizer)
        self.scaler = DynamicLossScaler(
            init_scale=2.0**config.initial_loss_scale_power,
            growth_interval=config.loss_scale_window,
            min_scale=config.min_loss_scale,
            enabled=policy.needs_loss_scaling,
        )
        on_reduced = (lambda f: f.release()) if self.stage.shard_params else None
        links = {}  # each dp group's measured links, for the algorithms that need them
        if config.allreduce_algorithm in ("auto", "hierarchical"):
            groups = {f.group.ranks: f.group for f in self.flats if f.group.size > 1}
            links = {ranks: discover(g).links() for ranks, g in groups.items()}
        self.reducer = GradReducer(self.flats, on_reduced, config.allreduce_algorithm, links)
        self.steps = Steps()
        self.grad_norm: float | None = None
        self.init_peak.set_base(sum(self.memory()[k] for k in KINDS))
        self.init_peak.note(eager_bytes)  # a model built eagerly was held whole beside it

    # ---- construction ----

    def _extra_styles(self, model: nn.Module) -> ExtraStyles | None:
        """Styles the engine adds to the plan's placements: on a mesh with a pp axis, each
        rank's model is its own pipeline stage (a pipeline engine adds the tied copies)."""
        if self.mesh is None or self.mesh.pp_size == 1:
            return None
        return lambda name, p: {Axis.PP: StageOwned()}

    def _overflow_group(self) -> Group | None:
        """The group that agrees on fp16 overflow beyond the norm's reduction (none here: the
        norm spans every rank that steps together)."""
        return None

    def _cast_inputs(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            a.to(self.dtypes.param) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        )

    def placement(self, param: torch.Tensor) -> Placement:
        """Where ``param`` (a parameter of ``self.module``) lives on the mesh: per axis
        ``Shard``, ``Replicate`` or ``StageOwned`` (ZeRO's flat sharding over the dp group comes
        on top, see ``self.flats``)."""
        return self.placements.of(param)

    def writes_buffer(self, name: str) -> bool:
        """Whether this rank writes buffer ``name`` (a state-dict key) to a checkpoint: one
        holder of its copies, the first rank of the dp group (and of tp in a mesh)."""
        mesh = self.mesh
        inside = (a for a in AXIS_ORDER if a not in (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD))
        return self.dp_group.rank == 0 and (mesh is None or all(mesh.rank(a) == 0 for a in inside))

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

    def backward(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        grad_tensors: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Backward, with gradient reduction overlapped. Communicates: see ``GradReducer``.

        ``backward(loss)``: from a scalar loss, divided by the accumulation steps (and, in fp16,
        multiplied by the loss scale). ``backward(outputs, grads)``: from gradients received for
        this stage's outputs (a pipeline stage that is not the last), used as given: they are
        the next stage's input gradients and already carry its division by the accumulation
        steps and, in fp16, its loss scale. Every stage's engine starts from the same scale and
        skips the same steps (the gradient norm spans every mesh axis), so the scales agree and
        ``step()`` unscales the received part correctly.
        """
        outputs, grads = backward_args(tensors, grad_tensors)
        if self._schedule is not None:
            self._schedule.finish_forward_recording()
        self.reducer.begin(
            self.is_boundary or self.stage.reduce_every_micro_step, last=self.is_boundary
        )
        if grads is None:
            accum = self.config.gradient_accumulation_steps
            outputs = [self.scaler.scale_loss(outputs[0].float() / accum)]
        try:
            torch.autograd.backward(outputs, grads)
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
            self.flats,
            self.optimizer,
            self.scaler,
            self.config.gradient_clipping,
            self.norm,
            self._overflow_group(),
        )
        self.grad_norm = result.grad_norm
        self.zero_grad()
        if result.updated:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_step += 1
            return True
        self.skipped_steps += 1
        me = self.group.ranks[self.group.rank]
        if self.scaler.enabled:
            log.warning(
                "rank %d: step %d skipped: gradient overflow; loss scale now %g",
                me,
                self.global_step,
                self.scaler.scale,
            )
            return False
        what = f"the global gradient norm is {result.grad_norm} at step {self.global_step}"
        if self.config.nonfinite_grads == "raise":
            raise FloatingPointError(
                f"{what}; the step was not applied (set Config(nonfinite_grads='skip') to "
                f"skip such steps with a warning instead)"
            )
        log.warning("rank %d: step skipped: %s (%d skipped so far)", me, what, self.skipped_steps)
        return False

    def zero_grad(self) -> None:
        """Drop accumulated gradients (kept gradient buffers are zeroed in place)."""
        zero_grads(self.flats)

    # ---- state ----

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state keyed by the original names, parameters at master
        precision: parameters split by parallel layers (tensor parallelism) are gathered whole,
        vocabulary padding cut, so it loads into the plain model. Communicates: see
        ``param_access.full_state_dict`` (an all_gather per flat buffer at stages 1-3, one
        per split parameter over its split group)."""
        return param_access.full_state_dict(self.module, self.flats, self.placements)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full model state (as ``state_dict`` returns, or the plain model's): each
        rank keeps its piece of every split parameter; communicates nothing."""
        param_access.load_full_state_dict(
            self.module, self._where, state, self.device, self.placements
        )

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: see ``shardwise.engine.memory.memory_report``; plus
        ``init_peak``, the most it held while it was initialized and loaded (see
        ``shardwise.deferred.peak.InitPeak``)."""
        report = memory_report(
            self.module,
            self.flats,
            self.optimizer,
            self.device,
            self.host,
            self.reducer.comm_bytes(),
        )
        report["init_peak"] = self.init_peak.peak
        return report

    @contextmanager
    def gathered_parameters(
        self,
        params: Sequence[torch.Tensor] | torch.Tensor | None = None,
        modifier_rank: int | None = None,
    ) -> Iterator[None]:
        """The full parameters of ``self.module`` (all, or those holding ``params``) inside a
        ``with`` block; call on every rank. ``modifier_rank``: that global rank's changes are
        written back into every shard and master copy on exit. See
        ``param_access.gathered_parameters`` (what it communicates)."""
        with param_access.gathered_parameters(self.flats, params, modifier_rank):
            yield

    # ---- checkpoints (see shardwise.engine.checkpoint) ----

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (skipped ones not counted)."""
        return self.steps.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.steps.global_step = value

    @property
    def micro_step(self) -> int:
        """Backward passes taken."""
        return self.steps.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self.steps.micro_step = value

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (fp16 overflow, non-finite gradients)."""
        return self.steps.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.steps.skipped_steps = value

    def checkpoint_state(self) -> CheckpointState:
        """What a checkpoint of this engine saves and loads (see ``CheckpointState``)."""
        mesh = self.mesh
        return CheckpointState(
            config=self.config,
            save_group=self.dp_group if mesh is None else mesh.group(*AXIS_ORDER),
            shard_group=self.group,
            dp_size=self.dp_group.size,
            pp_group=None if mesh is None or mesh.pp_size == 1 else mesh.group(Axis.PP),
            tp_size=1 if mesh is None else mesh.tp_size,
            stage=self.stage,
            module=self.module,
            flats=tuple(self.flats),
            placements=self.placements,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            scaler=self.scaler,
            writes_buffer=self.writes_buffer,
            steps=self.steps,
        )

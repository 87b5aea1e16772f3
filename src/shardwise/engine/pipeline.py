"""The engine of a pipeline-parallel model: ZeRO 0-3 over the dp axis of each stage, one
optimizer step per ``train_batch``, in fp32, bf16 or fp16 (fp32 master weights; fp16 with a
dynamic loss scale whose overflow decision every rank of the mesh agrees on).

mesh = shardwise.Mesh(pp=2, dp=2)
pipe = PipelineModule(layers, loss_fn, mesh)
engine = shardwise.initialize(pipe, torch.optim.AdamW(pipe.parameters()),
                              shardwise.Config(zero_stage=1, pipeline_microbatches=8), group=mesh)
loss = engine.train_batch(x, y)   # this dp rank's batch
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group
from shardwise.config import Config
from shardwise.engine.core import Engine, SchedulerFactory
from shardwise.engine.placements import ExtraStyles
from shardwise.mesh import AXIS_ORDER, Axis, Mesh
from shardwise.parallel.pipeline.executor import PipelineExecutor
from shardwise.parallel.pipeline.stage import PipelineModule
from shardwise.parallel.placement import Placement
from shardwise.zero import optimizer as zero_opt

SUPPORTED_STAGES = (0, 1, 2, 3)


def check_pipeline_config(pipe: PipelineModule, config: Config, group: Any) -> None:
    """Refuse what the pipeline engine cannot run exactly, naming what it supports."""
    if not isinstance(group, Mesh) or group is not pipe.mesh:
        raise ValueError(
            "a PipelineModule trains over its own mesh: pass group=mesh, the Mesh the "
            "PipelineModule was built on"
        )
    if config.zero_stage not in SUPPORTED_STAGES:
        raise ValueError(
            f"zero_stage={config.zero_stage} is not supported with a PipelineModule; supported: "
            f"zero_stage 0, 1, 2 or 3 (over the dp axis of each stage)"
        )
    if config.pipeline_virtual_stages not in (None, pipe.virtual_stages):
        raise ValueError(
            f"pipeline_virtual_stages={config.pipeline_virtual_stages} but the PipelineModule "
            f"was built with virtual_stages={pipe.virtual_stages}; leave "
            "pipeline_virtual_stages out (the PipelineModule states it)"
        )


class PipelineEngine(Engine):
    """An ``Engine`` over a ``PipelineModule``: ``train_batch`` and ``eval_batch`` run the
    configured schedule (``Config.pipeline_schedule``, ``pipeline_microbatches``,
    ``pipeline_virtual_stages``). Build it with ``shardwise.initialize(pipe, ..., group=mesh)``.

    Gradients accumulate over every micro-batch of the step unreduced; then the tied weights'
    gradients are summed over their holders (one all_reduce per tied key), then each stage's
    gradients are reduced over dp (stage 0 all_reduce, stages 1-3 reduce_scatter) once per
    step. The gradient norm counts a tied weight once and sums over every pp rank.

    At ZeRO-3 a stage's parameters are shards between uses. With
    ``Config(pipeline_zero3_regather=True)`` each micro-batch's forward gathers them and frees
    them after, and its backward gathers them again and frees them once done (nothing held
    between uses); with False they are gathered once at the start of
    ``train_batch`` and kept until every micro-batch's backward is done (one all_gather per
    buffer per step, the whole stage's parameters held meanwhile).

    In bf16 / fp16 each stage computes and sends activations and gradients in that dtype and
    steps fp32 master weights (as ``Engine``). In fp16 the last stage's loss is multiplied by
    the loss scale, so every gradient crossing a stage boundary carries it; whether any rank
    overflowed is decided by one all_reduce over the whole mesh, so every stage and dp rank
    skips the same steps and keeps the same scale.
    """

    def __init__(
        self,
        pipe: PipelineModule,
        optimizer: zero_opt.OptimizerLike,
        config: Config,
        group: Mesh,
        lr_scheduler: SchedulerFactory | None = None,
        placements: Mapping[str, Placement] | None = None,
        init_fn: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        check_pipeline_config(pipe, config, group)
        super().__init__(pipe, optimizer, config, group, lr_scheduler, placements, init_fn)
        self.pipe = pipe
        self.executor = PipelineExecutor(
            pipe, config.pipeline_schedule, config.pipeline_microbatches
        )
        schedule = self._schedule
        if schedule is not None and config.pipeline_zero3_regather:
            # each micro-batch's backward gathered what it used: free it until the next use
            self.executor.after_backward = lambda: schedule.finish_backward(self.flats)

    def _overflow_group(self) -> Group | None:
        """Every rank of the mesh steps together: all of them agree on fp16 overflow."""
        return self.mesh.group(*AXIS_ORDER) if self.mesh is not None else None

    def _extra_styles(self, model: torch.nn.Module) -> ExtraStyles:
        """Every parameter belongs to its pp stage; a tied one is copied on its holders (a
        checkpoint stores it once, from the first; the norm counts it once)."""
        assert isinstance(model, PipelineModule)
        return lambda name, p: {Axis.PP: model.stage_style(p)}

    def writes_buffer(self, name: str) -> bool:
        """Each stage writes its own buffers; a tied module's, its first holder only."""
        return super().writes_buffer(name) and not self.pipe.is_tied_copy(name)

    def _chunks(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        accum = self.config.gradient_accumulation_steps
        per = accum * self.config.pipeline_microbatches
        if t.dim() == 0 or t.shape[0] % per:
            raise ValueError(
                f"{what} batch of shape {tuple(t.shape)} does not split into "
                f"gradient_accumulation_steps x pipeline_microbatches = {accum} x "
                f"{self.config.pipeline_microbatches} equal micro-batches; use a batch size "
                f"divisible by {per}"
            )
        if t.is_floating_point():  # floating inputs follow the compute dtype
            t = t.to(self.dtypes.param)
        return list(t.chunk(accum))

    def _mean_over_dp(self, loss: torch.Tensor) -> torch.Tensor:
        if self.dp_group.size > 1:  # every dp rank: shard groups and their replicas
            ops.all_reduce(loss, op="avg", group=self.dp_group)
        return loss

    def train_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step over this dp rank's batch (every pp rank of a pipeline passes the
        same ``x`` and ``y``): ``gradient_accumulation_steps`` chunks of
        ``pipeline_microbatches`` micro-batches each, gradients equal to the whole batch's
        mean-loss gradient (times the loss scale in fp16), then ``step()`` (unscaling, clipping
        with the norm over all stages; fp16: skipped everywhere on overflow). Returns
        the batch's mean loss averaged over dp, on every rank. Communicates: the schedule's
        send/recv, one all_reduce per tied key, the dp reduction of every gradient buffer, the
        step's collectives (see ``zero.step``; fp16: one 4-byte all_reduce over the whole mesh
        for the overflow decision), the loss (4 bytes over pp and over dp); ZeRO-3: an
        all_gather per flat buffer for each micro-batch's forward and backward
        (``pipeline_zero3_regather``), or once per step."""
        xs, ys = self._chunks(x, "input"), self._chunks(y, "target")
        accum = len(xs)
        self.reducer.begin(False, last=True)
        total = torch.zeros((), dtype=torch.float32)
        grad_scale = self.scaler.scale / accum
        sched = self._schedule
        kept = sched if sched is not None and not self.config.pipeline_zero3_regather else None
        if kept is not None:  # ZeRO-3, gathered once for every micro-batch of the step
            kept.hold()
        try:
            for xk, yk in zip(xs, ys):
                total += self.executor.train_batch(xk, yk, grad_scale=grad_scale, reduce_tied=False)
        finally:
            if kept is not None:
                kept.unhold()
            if sched is not None:
                sched.finish_backward(self.flats)
        self.pipe.reduce_tied_grads(self.reducer.full_grad)
        self.reducer.reduce_all()
        self.micro_step += accum
        self.step()
        return self._mean_over_dp(total / accum)

    @torch.no_grad()
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only over this dp rank's batch in ``pipeline_microbatches`` micro-batches;
        the mean loss averaged over dp, on every rank."""
        if x.is_floating_point():
            x = x.to(self.dtypes.param)
        return self._mean_over_dp(self.executor.eval_batch(x, y))

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "a pipeline engine runs forward and backward through its schedule: use "
            "engine.train_batch(x, y) (or eval_batch for forward only)"
        )

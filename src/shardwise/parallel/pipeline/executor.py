"""Run a schedule's actions on real ranks: forward and backward of micro-batches per stage,
activations and gradients between stages through ``shardwise.comm``.

The schedule is simulated once at construction (``ScheduleError`` names the ranks if it would
deadlock or is incomplete), so what runs is what was proven. Gradients equal those of the
whole batch in one process: each micro-batch's mean loss is scaled by ``grad_scale / m``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.comm import ops
from shardwise.parallel.pipeline.channel import Channel
from shardwise.parallel.pipeline.schedule import Action, Kind, Schedule, build_schedule
from shardwise.parallel.pipeline.simulate import run_schedule
from shardwise.parallel.pipeline.stage import PipelineModule

Key = tuple[int, int]  # (stage, micro-batch)


class _GradSink(torch.autograd.Function):
    """A 0-d handle on a stage's output: backward through it feeds the output's gradient
    (set later in ``box``), so the output itself can be freed once it has been sent."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, box: list[torch.Tensor]) -> torch.Tensor:
        ctx.box = box
        return out.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.box[0], None


@dataclass
class _Saved:
    inp: torch.Tensor | None  # the stage's input when it needs a gradient
    anchor: torch.Tensor | None  # backward starts here (scaled loss, or a _GradSink handle)
    box: list[torch.Tensor] | None  # where the output's gradient goes (None on the last stage)


@dataclass
class _StepState:
    x: list[torch.Tensor]
    y: list[torch.Tensor]
    train: bool
    scale: float
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    saved: dict[Key, _Saved] = field(default_factory=dict)
    out_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    in_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StepTimes:
    """Where this rank's last step went: wall time, time in compute actions, and each compute
    action's (action, start, end) in seconds from the step's start."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    slots: list[tuple[Action, float, float]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Measured idle time over compute time on this rank (the simulator's ``bubble_of``)."""
        return (self.wall_s - self.busy_s) / self.busy_s if self.busy_s else 0.0

    def stage_seconds(self) -> dict[int, dict[str, float]]:
        """Per stage of this rank: seconds in forward (F) and in backward (B, I and W)."""
        out: dict[int, dict[str, float]] = {}
        for a, t0, t1 in self.slots:
            entry = out.setdefault(a.stage, {"forward_s": 0.0, "backward_s": 0.0})
            entry["forward_s" if a.kind is Kind.F else "backward_s"] += t1 - t0
        return out


class PipelineExecutor:
    """Runs ``pipe`` through a pipeline schedule, one step per ``train_batch``.

    Args:
        pipe: this rank's stages.
        schedule: a name (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb_h1``) or a
            ``Schedule`` built for ``pipe``'s pp size and virtual stages.
        microbatches: micro-batches per step (with a schedule name).

    Communicates per step: one send/recv per stage boundary per micro-batch each way (plus one
    shape message per boundary), one broadcast of the loss over pp, and the tied-weight
    all_reduce. Each receive is posted ahead of its action, once the one before it from the
    same peer is done and this step's shape of its boundary is known, so its payload arrives
    while this rank computes (one receive buffer ahead per peer). The zero-bubble split (I, W)
    computes the input gradient first and the weight gradient from the retained graph later,
    traversing the stage's backward graph twice.
    """

    def __init__(
        self, pipe: PipelineModule, schedule: str | Schedule = "1f1b", microbatches: int = 1
    ) -> None:
        if isinstance(schedule, str):
            schedule = build_schedule(schedule, pipe.pp_size, microbatches, pipe.virtual_stages)
        if (schedule.pp_size, schedule.virtual_stages) != (pipe.pp_size, pipe.virtual_stages):
            raise ValueError(
                f"schedule is for pp={schedule.pp_size}, virtual stages="
                f"{schedule.virtual_stages}; the module has pp={pipe.pp_size}, virtual stages="
                f"{pipe.virtual_stages}"
            )
        run_schedule(schedule)  # refuse a deadlocking or incomplete schedule before running it
        self.pipe, self.schedule = pipe, schedule
        self.actions = schedule.actions[pipe.pp_rank]
        self.channel = Channel(pipe.pp_group)
        self.steps = 0
        self.last_step = StepTimes()
        # called after each backward action (B, I, W): e.g. ZeRO-3 frees what it gathered
        self.after_backward: Callable[[], None] | None = None
        # the times of recent steps (training and evaluation), until ``take_step_times``
        self._recent: deque[StepTimes] = deque(maxlen=1024)
        self._peer = dict(enumerate(pipe.pp_group.ranks))  # pp rank -> world rank
        # each peer's receives of a step in order, training and forward only
        self._receives = {train: self._receives_of(train) for train in (True, False)}

    def _receives_of(self, train: bool) -> dict[int, tuple[Action, ...]]:
        out: dict[int, list[Action]] = {}
        for a in self.actions:
            if a.kind is Kind.RECV_ACT or (train and a.kind is Kind.RECV_GRAD):
                out.setdefault(a.peer, []).append(a)
        return {peer: tuple(rs) for peer, rs in out.items()}

    def _post_ahead(self, ahead: dict[int, deque[Action]]) -> None:
        """Post each peer's next receive as soon as it can go (``Channel.post_recv``): its
        payload moves while this rank computes. One receive ahead per peer at most."""
        for queue in ahead.values():
            if queue:
                a = queue[0]
                kind = 0 if a.kind is Kind.RECV_ACT else 1
                self.channel.post_recv(kind, a.stage, a.mb, self._peer[a.peer])

    def take_step_times(self) -> list[StepTimes]:
        """The times of the steps run since the last call (at most 1024), oldest first; an
        optimizer step with gradient accumulation runs one per accumulation step."""
        out = list(self._recent)
        self._recent.clear()
        return out

    def _split(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        m = self.schedule.microbatches
        if t.dim() == 0 or t.shape[0] % m:
            raise ValueError(
                f"{what} batch of {tuple(t.shape)} does not split into {m} equal micro-batches; "
                f"use a batch size divisible by {m}"
            )
        return list(t.chunk(m))

    def train_batch(
        self, x: torch.Tensor, y: torch.Tensor, *, grad_scale: float = 1.0, reduce_tied: bool = True
    ) -> torch.Tensor:
        """Forward and backward of one batch (every pp rank passes the same ``x`` and ``y``;
        the first stage reads ``x``, the last ``y``). Gradients accumulate into ``.grad`` as
        ``grad_scale`` times the whole batch's mean-loss gradient (``grad_scale = 1/k`` for k
        accumulation steps; ``reduce_tied=False`` on all but the last). Returns the mean loss
        on every pp rank."""
        return self._run(x, y, train=True, scale=grad_scale, reduce_tied=reduce_tied)

    @torch.no_grad()
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only; the mean loss on every pp rank."""
        return self._run(x, y, train=False, scale=1.0, reduce_tied=False)

    def _run(
        self, x: torch.Tensor, y: torch.Tensor, train: bool, scale: float, reduce_tied: bool
    ) -> torch.Tensor:
        st = _StepState(self._split(x, "input"), self._split(y, "target"), train, scale)
        self.channel.begin_step(self.steps)
        times = StepTimes()
        ahead = {peer: deque(rs) for peer, rs in self._receives[train].items()}
        start = time.perf_counter()
        try:
            for a in self.actions:
                if train or a.kind in (Kind.F, Kind.SEND_ACT, Kind.RECV_ACT):
                    t0 = time.perf_counter()
                    self._do(a, st)
                    if a.kind.is_compute:
                        t1 = time.perf_counter()
                        times.slots.append((a, t0 - start, t1 - start))
                        times.busy_s += t1 - t0
                    elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                        ahead[a.peer].popleft()
                    self._post_ahead(ahead)
                self.channel.release_completed()
            self.channel.wait_all()
        finally:
            self.steps += 1
        times.wall_s = time.perf_counter() - start
        self.last_step = times
        self._recent.append(times)
        if train and reduce_tied:
            self.pipe.reduce_tied_grads()
        return self._mean_loss(st)

    def _mean_loss(self, st: _StepState) -> torch.Tensor:
        last = self.pipe.num_stages - 1
        loss = torch.zeros((), dtype=torch.float32)
        if last in self.pipe.stage_ids:
            loss = torch.stack(st.losses).float().mean()
        src = self._peer[self.schedule.rank_of(last)]
        ops.broadcast(loss, src=src, group=self.pipe.pp_group)
        return loss

    def _do(self, a: Action, st: _StepState) -> None:
        key = (a.stage, a.mb)
        if a.kind is Kind.F:
            self._forward(a.stage, a.mb, st)
        elif a.kind is Kind.SEND_ACT:
            self.channel.send_activation(st.outputs.pop(key), a.stage, a.mb, self._peer[a.peer])
        elif a.kind is Kind.RECV_ACT:
            buf = self.channel.recv_activation(a.stage, a.mb, self._peer[a.peer])
            st.inputs[(a.stage + 1, a.mb)] = buf.requires_grad_(st.train)
        elif a.kind is Kind.SEND_GRAD:
            self.channel.send_gradient(st.in_grads.pop(key), a.stage, a.mb, self._peer[a.peer])
        elif a.kind is Kind.RECV_GRAD:
            g = self.channel.recv_gradient(a.stage, a.mb, self._peer[a.peer])
            st.out_grads[(a.stage - 1, a.mb)] = g
        else:
            if a.kind in (Kind.B, Kind.I):
                self._backward_input(a.stage, a.mb, st, full=a.kind is Kind.B)
            else:
                self._backward_weight(a.stage, a.mb, st)
            if self.after_backward is not None:
                self.after_backward()

    def _forward(self, stage: int, mb: int, st: _StepState) -> None:
        inp = st.x[mb] if stage == 0 else st.inputs.pop((stage, mb))
        box: list[torch.Tensor] | None = None
        anchor: torch.Tensor | None = None
        with torch.set_grad_enabled(st.train):
            out = self.pipe.forward_stage(stage, inp)
            last = stage == self.pipe.num_stages - 1
            if last:
                loss = self.pipe.loss_fn(out, st.y[mb])
                st.losses.append(loss.detach())
                # in fp32: a loss scale times an fp16 loss would overflow fp16 itself
                anchor = loss.float() * (st.scale / self.schedule.microbatches)
            elif out.requires_grad:
                box = []
                anchor = _GradSink.apply(out, box)
        if st.train:
            needs_grad = stage > 0 and inp.requires_grad
            st.saved[(stage, mb)] = _Saved(inp if needs_grad else None, anchor, box)
        if not last:
            out = out.detach()
            if self.schedule.rank_of(stage + 1) == self.pipe.pp_rank:
                st.inputs[(stage + 1, mb)] = out.requires_grad_(st.train)
            else:
                st.outputs[(stage, mb)] = out

    def _backward_input(self, stage: int, mb: int, st: _StepState, full: bool) -> None:
        """B (``full``): input and weight gradients; I: the input gradient only."""
        saved = st.saved[(stage, mb)] if not full else st.saved.pop((stage, mb))
        if saved.box is not None:
            saved.box.append(st.out_grads.pop((stage, mb)))
        if saved.anchor is None:
            grad = None
        elif full:
            torch.autograd.backward(saved.anchor)
            grad = saved.inp.grad if saved.inp is not None else None
        elif saved.inp is not None:
            (grad,) = torch.autograd.grad(saved.anchor, [saved.inp], retain_graph=True)
        else:
            grad = None
        if stage == 0:
            return
        if grad is None:
            raise ValueError(
                f"pipeline stage {stage}'s output does not depend on its input; no gradient can "
                "flow to the stages before it"
            )
        if self.schedule.rank_of(stage - 1) == self.pipe.pp_rank:
            st.out_grads[(stage - 1, mb)] = grad
        else:
            st.in_grads[(stage, mb)] = grad

    def _backward_weight(self, stage: int, mb: int, st: _StepState) -> None:
        """W: the weight gradients of ``stage`` for ``mb``, from the graph I retained."""
        saved = st.saved.pop((stage, mb))
        params = [p for p in self.pipe.stage_parameters(stage) if p.requires_grad]
        if saved.anchor is not None and params:
            torch.autograd.backward(saved.anchor, inputs=params)

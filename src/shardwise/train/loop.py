"""The per-rank training loop of ``shardwise train``: a GPT on a byte-level corpus.

Every rank builds the same model, wraps it with ``shardwise.initialize`` and reads its own slice
of each global batch. After every step the ranks exchange one small record (loss, step time,
memory, communication, whether a stop signal arrived) with ``all_gather_object``; rank 0 logs
it. A stop signal ends the run after the step in which any rank saw it, on every rank.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

import shardwise
from shardwise.comm import World, objects, ops
from shardwise.data import DistributedBatchSampler, load_corpus
from shardwise.engine.core import Engine
from shardwise.engine.pipeline import PipelineEngine
from shardwise.mesh import Axis
from shardwise.train import checkpoints
from shardwise.train.lr_schedule import lr_at
from shardwise.train.metrics import MetricsWriter, read_metrics
from shardwise.train.options import RunConfig
from shardwise.train.parallel import BuiltModel, build_mesh, build_model
from shardwise.train.pipeline_metrics import local_times, pipeline_record
from shardwise.train.plan_check import PlanCheck
from shardwise.train.progress import Progress, format_rate
from shardwise.train.rundir import RunDir
from shardwise.train.stop import StopRequest
from shardwise.train.summary import build_summary, discard_summary, write_summary

log = logging.getLogger("shardwise.train")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices of linear layers only; none on biases, norms and
    embeddings (decaying those toward zero only hurts)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen (a LoRA base): not the optimizer's
            continue
        (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class Trainer:
    """One rank's share of a run; ``run()`` trains.

    Args:
        run: the resolved run config (``config.json``).
        run_dir: where metrics, checkpoints and the final model go.
        resume: continue from the newest checkpoint in ``run_dir``.
        world: the world of ranks that runs it (``shardwise.init()``).
    """

    def __init__(self, run: RunConfig, run_dir: RunDir, resume: bool, world: World) -> None:
        self.run_cfg, self.dir, self.opts = run, run_dir, run.train
        self.world = world
        self.rank = world.rank
        if world.world_size != run.world_size:
            raise ValueError(
                f"the run is configured for {run.world_size} ranks but "
                f"{world.world_size} started: launch it with matching --nproc-per-node"
            )
        self.mesh = build_mesh(run, world)
        # data: each dp rank reads its own slice of a batch; its tp (and pp) peers the same
        self.dp = self.mesh.group(Axis.DP)
        self.started = time.perf_counter()
        if resume and self.rank == 0:  # if this launch fails, no summary says the run ended
            discard_summary(run_dir.summary)
        # the same model on every rank, its stages of it under --pp, tp-split under --tp
        self.built = self.build_model()
        model = self.built.module
        optimizer = torch.optim.AdamW(
            param_groups(model, self.opts.weight_decay), lr=self.opts.lr, betas=(0.9, 0.95)
        )
        engine_cfg = run_dir.engine_config(run.engine)  # this run dir's checkpoints, always
        engine_cfg = engine_cfg.replace(resume="auto") if resume else engine_cfg
        self.engine: Engine = shardwise.initialize(
            self.built.parallelized, optimizer, engine_cfg, **self.initialize_kwargs()
        )
        self.pipe = self.engine if isinstance(self.engine, PipelineEngine) else None
        self.sampler = self.build_sampler()
        self.step = 0
        self.resumed = resume
        if resume:
            found = checkpoints.resume(self.engine, self.sampler)
            self.step = found or 0
        # the optimizer step of the newest checkpoint (a resumed run starts at one)
        self.saved_step: int | None = self.engine.global_step if self.step else None
        world.stats.reset()  # setup's broadcasts and loading are not the first step's
        self.last_val: float | None = None
        self.prior_wall_s = 0.0  # earlier launches of a resumed run (rank 0 knows it)
        # an --auto run's prediction, checked against its steps (rank 0)
        self.check = PlanCheck.load(run_dir.root) if self.rank == 0 else None

    # ---- what a kind of run decides (a fine-tuning run overrides these) ----

    def build_model(self) -> BuiltModel:
        """This rank's model, parallelized; also reads the corpus."""
        self.corpus = load_corpus(self.opts.data, max_bytes=self.opts.max_bytes)
        return build_model(self.run_cfg, self.mesh)

    def initialize_kwargs(self) -> dict[str, Any]:
        """More arguments for ``shardwise.initialize`` (where the weights come from)."""
        return {}

    def build_sampler(self) -> Any:
        """This dp rank's batches (``next_batch``), resumable (``state_dict``)."""
        run = self.run_cfg
        return DistributedBatchSampler(
            self.corpus.train,
            run.model.seq_len,
            run.micro_batch,
            self.dp.rank,
            self.dp.size,
            seed=run.engine.seed,
            grad_accum=run.engine.gradient_accumulation_steps,
        )

    def micro_losses(self) -> list[float]:
        """Forward and backward over this rank's micro-batches of one step; their losses."""
        losses = []
        for _ in range(self.run_cfg.engine.gradient_accumulation_steps):
            x, y = self.sampler.next_batch()  # [micro_batch, seq_len] each
            loss = self.built.forward_loss(self.engine, x, y)
            self.engine.backward(loss)
            losses.append(float(loss.detach()))
        return losses

    def has_validation(self) -> bool:
        """Whether ``evaluate`` has data (the corpus always has a validation split)."""
        return True

    def baseline(self) -> float | None:
        """A loss to compare against (the corpus's unigram entropy), logged and summarized."""
        return self.corpus.unigram_entropy()

    def headline(self) -> str:
        """The first progress line: what is trained, on what."""
        return f"training {self.run_cfg.model.param_count() / 1e6:.2f}M params"

    def tokens_per_step(self) -> int:
        return self.run_cfg.tokens_per_step

    def save_outputs(self, lead: bool) -> None:
        """What the run leaves at its end (every rank calls it): the final model file."""
        checkpoints.save_final_model(
            self.engine, self.dir.final_model, self.step, lead, self.built, self.mesh
        )

    # ---- one step ----

    def _set_lr(self) -> float:
        lr = lr_at(
            self.step,
            peak=self.opts.lr,
            total=self.opts.steps,
            warmup=self.opts.warmup,
            min_ratio=self.opts.min_lr_ratio,
        )
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _train_step(self, stop: StopRequest) -> dict[str, Any]:
        """Forward, backward and optimizer step over this rank's micro-batches; returns this
        rank's part of the step record."""
        lr = self._set_lr()
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if self.pipe is not None:
            losses, memory, extra["pipeline"] = self._pipeline_step()
        else:
            losses = self.micro_losses()
            memory = self.engine.memory()  # gradients are held: the step's peak of model states
            t_opt = time.perf_counter()
            self.engine.step()
            extra["optimizer_s"] = time.perf_counter() - t_opt
        step_time = time.perf_counter() - t0
        # exposed time first: snapshot(reset=True) clears it too
        exposed = self.world.stats.exposed()
        comm_ops = self.world.stats.snapshot(reset=True)
        return {
            "loss": sum(losses) / len(losses),
            "lr": lr,
            "step_time_s": step_time,
            "exposed_comm_s": exposed,
            "comm": comm_ops,
            "memory": memory,
            "grad_norm": self.engine.grad_norm,
            "stop": int(stop.signal) if stop.signal is not None else 0,
            **extra,
        }

    def _pipeline_step(self) -> tuple[list[float], dict[str, int], dict[str, Any]]:
        """One ``train_batch`` over this dp rank's micro-batches of the step, concatenated (the
        engine splits them back into accumulation steps, then pipeline micro-batches)."""
        assert self.pipe is not None
        local_times(self.pipe.executor)  # evaluation's steps are not this one's
        batches = [
            self.sampler.next_batch()
            for _ in range(self.run_cfg.engine.gradient_accumulation_steps)
        ]
        x = torch.cat([b[0] for b in batches])  # [accum * micro_batch, seq_len]
        y = torch.cat([b[1] for b in batches])
        loss = self.pipe.train_batch(*self.built.split(x, y))  # averaged over dp already
        return [float(loss)], self.engine.memory(), local_times(self.pipe.executor)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss over ``eval_batches`` micro-batches per dp rank (the same ones at every
        evaluation), averaged over the dp group. Communicates: one all_reduce of one float."""
        cfg = self.run_cfg.model
        val = DistributedBatchSampler(
            self.corpus.val,
            cfg.seq_len,
            self.run_cfg.micro_batch,
            self.dp.rank,
            self.dp.size,
            seed=self.run_cfg.engine.seed,
        )
        self.engine.eval()
        total = 0.0
        for _ in range(self.opts.eval_batches):
            x, y = val.next_batch()
            if self.pipe is None:
                loss = self.built.forward_loss(self.engine, x, y)
            else:
                loss = self.pipe.eval_batch(*self.built.split(x, y))
            total += float(loss.float())
        self.engine.train()
        mean = torch.tensor([total / self.opts.eval_batches], dtype=torch.float64)
        ops.all_reduce(mean, op="avg", group=self.dp)
        return float(mean[0])

    def _record(self, parts: list[dict[str, Any]], val_loss: float | None) -> dict[str, Any]:
        step_time = max(p["step_time_s"] for p in parts)
        tokens = self.tokens_per_step()
        record = {
            "step": self.step,
            "loss": sum(p["loss"] for p in parts) / len(parts),
            "lr": parts[0]["lr"],
            "grad_norm": parts[0]["grad_norm"],
            "tokens": tokens,
            "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "step_time_s": step_time,
            "comm": parts[0]["comm"],
            "exposed_comm_s": [p["exposed_comm_s"] for p in parts],
            "memory": [p["memory"] for p in parts],
            "elapsed_s": time.perf_counter() - self.started,
            "wall_s": self.prior_wall_s + time.perf_counter() - self.started,
        }
        if self.pipe is None:
            record["optimizer_s"] = max(p["optimizer_s"] for p in parts)
        else:
            record["pipeline"] = pipeline_record(parts, self.mesh)
        if val_loss is not None:
            record["val_loss"] = val_loss
        if self.check is not None:
            self.check.observe(record)
        return record

    def _save_checkpoint(self) -> None:
        """Save unless this optimizer step is saved already (an fp16 step skipped on overflow
        leaves ``global_step`` where it was, and a checkpoint is never written twice)."""
        if self.saved_step == self.engine.global_step:
            return
        checkpoints.save(self.engine, self.sampler, self.built)
        self.saved_step = self.engine.global_step

    # ---- the run ----

    def _loop(
        self, stop: StopRequest, writer: MetricsWriter | None, progress: Progress | None
    ) -> None:
        every, ckpt_every = self.opts.eval_every, self.run_cfg.engine.checkpoint_every
        while self.step < self.opts.steps:
            local = self._train_step(stop)
            self.step += 1
            parts = objects.all_gather_object(local, group=self.world.group)
            signals = [p["stop"] for p in parts if p["stop"]]
            val_loss = None
            due = self.step == self.opts.steps or (every and self.step % every == 0)
            if due and self.has_validation():
                val_loss = self.last_val = self.evaluate()
            if writer is not None and progress is not None:
                # the record first: a committed checkpoint's step always has its record, so a
                # resume cutting the metrics at that step loses none
                record = self._record(parts, val_loss)
                writer.write(record)
                progress.update(record)
            if ckpt_every and self.step % ckpt_every == 0 and not signals:
                self._save_checkpoint()
            self.world.stats.reset()  # bookkeeping, evaluation and saving are not the step's
            if signals:
                stop.stop_with(signals[0])
                return

    def run(self, stop: StopRequest) -> int:
        """Train up to ``steps``, or until ``stop`` (installed) sees a signal on any rank.
        Returns the exit code: 0, or 130 / 143 after SIGINT / SIGTERM.

        Whether finished or stopped, every rank then saves a checkpoint (when this build can)
        and rank 0 writes ``final_model.safetensors`` and ``summary.json``.
        """
        lead = self.rank == 0
        unigram = self.baseline()
        writer = (
            MetricsWriter(self.dir.metrics, self.step if self.resumed else None) if lead else None
        )
        if writer is not None and self.resumed:
            self.prior_wall_s = writer.prior_wall_s
        progress = Progress(self.opts.steps, self.step, self.opts.log_every) if lead else None
        if progress is not None:
            progress.message(
                f"{self.headline()} on "
                f"{self.world.world_size} ranks ({self.run_cfg.layout()}), "
                f"ZeRO-{self.run_cfg.engine.zero_stage}, "
                f"{self.run_cfg.engine.precision}, {self.tokens_per_step()} tokens/step"
                + ("" if unigram is None else f"; unigram baseline {unigram:.3f} nats")
            )
        try:
            self._loop(stop, writer, progress)
            # a signal from here on changes nothing: the ranks save and exit anyway
            self._save_checkpoint()
            checkpoints.finish_saving(self.engine)
            self.save_outputs(lead)
        finally:
            if progress is not None:
                progress.close()
            if writer is not None:
                writer.close()
        if lead:
            self._write_summary(stop, unigram)
        return stop.exit_code

    def _write_summary(self, stop: StopRequest, unigram: float | None) -> None:
        records = read_metrics(self.dir.metrics) if self.dir.metrics.exists() else []
        vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
        status = "finished"
        if stop.signal is not None and self.step < self.opts.steps:
            status = f"stopped by {stop.signal.name}"
        summary = build_summary(
            self.run_cfg,
            records,
            status=status,
            unigram_baseline=unigram,
            final_val_loss=vals[-1] if vals else None,
            wall_time_s=self.prior_wall_s + time.perf_counter() - self.started,
        )
        if self.check is not None:
            peaks = summary["memory"]["measured_peak_per_rank"]
            summary["plan"] = self.check.summary(records, [p["model_states"] for p in peaks])
        write_summary(self.dir.summary, summary)
        val = summary["final_val_loss"]
        rate = summary["tokens_per_s"]
        log.info(
            "%s at step %d: val loss %s%s, %s",
            status,
            summary["steps"],
            "n/a" if val is None else f"{val:.3f}",
            "" if unigram is None else f" (unigram baseline {unigram:.3f})",
            format_rate(rate) if rate else "n/a",
        )
        if val is not None and not math.isfinite(val):
            log.warning("the validation loss is not finite: lower --lr")

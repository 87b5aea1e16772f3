"""A tiny tied-embedding language model as pipeline layers, its single-process reference, and
rank tasks for the pipeline tests."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.parallel.pipeline import LayerSpec, PipelineExecutor, PipelineModule, Tied

VOCAB, DIM, SEQ, SEED = 11, 8, 3, 1234


class Lambda(nn.Module):
    """A layer that applies a function (no parameters)."""

    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Mix(nn.Module):
    """A residual MLP block: enough nonlinearity for gradients to mean something."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def head(emb: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def layers(n_blocks: int) -> list:
    emb = LayerSpec(nn.Embedding, VOCAB, DIM)
    blocks = [LayerSpec(Mix, DIM) for _ in range(n_blocks)]
    return [Tied("embed", emb), *blocks, Tied("embed", emb, forward_fn=head)]


def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (n, SEQ), generator=g)


class Reference(nn.Module):
    """The same model in one process, built from the same seeds as the pipeline's layers."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        entries = layers(n_blocks)
        self.emb = entries[0].source.build(SEED + 0)
        self.blocks = nn.ModuleList(e.build(SEED + i + 1) for i, e in enumerate(entries[1:-1]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return lm_loss(head(self.emb, h), y)

    def named_like_pipeline(self) -> dict[str, nn.Parameter]:
        out = {f"tied.embed.{k}": v for k, v in self.emb.named_parameters()}
        for i, b in enumerate(self.blocks):
            out.update({f"layers.{i + 1}.{k}": v for k, v in b.named_parameters()})
        return out


def grads_of(pipe: PipelineModule) -> dict[str, torch.Tensor]:
    """Every gradient this rank holds, under the whole model's names (tied on every holder)."""
    out = {f"layers.{k}": p.grad.clone() for k, p in pipe.layers.named_parameters()}
    for key, module in pipe.tied.items():
        out.update({f"tied.{key}.{k}": p.grad.clone() for k, p in module.named_parameters()})
    return out


def params_of(pipe: PipelineModule) -> dict[str, torch.Tensor]:
    out = {f"layers.{k}": p.detach().clone() for k, p in pipe.layers.named_parameters()}
    for key, module in pipe.tied.items():
        out.update({f"tied.{key}.{k}": p.detach().clone() for k, p in module.named_parameters()})
    return out


def task_grads(schedule: str, m: int, n_blocks: int, v: int, batch_size: int) -> dict:
    """One train_batch; this rank's loss and gradients."""
    mesh = shardwise.Mesh(pp=shardwise.world_size(), dp=1)
    pipe = PipelineModule(layers(n_blocks), lm_loss, mesh, virtual_stages=v, seed=SEED)
    run = PipelineExecutor(pipe, schedule, microbatches=m)
    x, y = batch(batch_size)
    loss = run.train_batch(x, y)
    return {"loss": loss.item(), "grads": grads_of(pipe), "stats": shardwise.comm_stats()}


def task_steps(schedule: str, m: int, n_blocks: int, steps: int, accumulation: int) -> dict:
    """``steps`` AdamW steps with clipping-free updates; accumulation splits each batch."""
    mesh = shardwise.Mesh(pp=shardwise.world_size(), dp=1)
    pipe = PipelineModule(layers(n_blocks), lm_loss, mesh, seed=SEED)
    run = PipelineExecutor(pipe, schedule, microbatches=m)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x, y = batch(8, seed=step)
        opt.zero_grad()
        total = torch.zeros(())
        for k, (xs, ys) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation))):
            last = k == accumulation - 1
            total += run.train_batch(xs, ys, grad_scale=1 / accumulation, reduce_tied=last)
        losses.append((total / accumulation).item())
        opt.step()
    return {"losses": losses, "params": params_of(pipe), "saved": pipe.stage_state_dict()}


class Sleep(nn.Module):
    """A stage that sleeps instead of computing: forward ``t_fwd``, backward ``t_bwd``."""

    def __init__(self, t_fwd: float, t_bwd: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.t_fwd, self.t_bwd = t_fwd, t_bwd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.t_fwd)
        return _SleepBackward.apply(x * self.scale, self.t_bwd)


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, t: float) -> torch.Tensor:  # type: ignore[override]
        ctx.t = t
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.t)
        return g, None


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def task_sleep(schedule: str, m: int, v: int, t_fwd: float, t_bwd: float) -> float:
    """Wall time of one step whose stages sleep (after one warm-up step)."""
    mesh = shardwise.Mesh(pp=shardwise.world_size(), dp=1)
    stages = [LayerSpec(Sleep, t_fwd, t_bwd) for _ in range(mesh.pp_size * v)]
    pipe = PipelineModule(stages, mse, mesh, "uniform", virtual_stages=v)
    run = PipelineExecutor(pipe, schedule, microbatches=m)
    x = torch.ones(m, 4)
    run.train_batch(x, x)
    shardwise.barrier()
    t0 = time.perf_counter()
    run.train_batch(x, x)
    shardwise.barrier()
    return time.perf_counter() - t0


def task_grads_many(configs: list[tuple[str, int, int]], n_blocks: int) -> list[dict]:
    """``task_grads`` for each (schedule, microbatches, virtual stages); a refused config
    yields its error message."""
    out = []
    for schedule, m, v in configs:
        shardwise.comm_stats(reset=True)
        try:
            out.append(task_grads(schedule, m, n_blocks, v, 8))
        except ValueError as exc:
            out.append({"refused": str(exc)})
    return out


def task_grads_dp(schedule: str, m: int, n_blocks: int) -> dict:
    """dp2 x pp2: each dp rank runs half the batch through its pipeline, then averages the
    gradients over dp; returns this rank's gradients and the measured step."""
    mesh = shardwise.Mesh(pp=2, dp=2)
    pipe = PipelineModule(layers(n_blocks), lm_loss, mesh, seed=SEED)
    run = PipelineExecutor(pipe, schedule, microbatches=m)
    x, y = batch(8)
    dp = mesh.rank("dp")
    loss = run.train_batch(x.chunk(2)[dp], y.chunk(2)[dp])
    shardwise.all_reduce(loss, op="avg", group=mesh.group("dp"))
    for p in pipe.parameters():
        shardwise.all_reduce(p.grad, op="avg", group=mesh.group("dp"))
    times = run.last_step
    return {
        "loss": loss.item(),
        "grads": grads_of(pipe),
        "coords": mesh.coords,
        "computes": len(times.slots),
        "busy_le_wall": 0 < times.busy_s <= times.wall_s,
    }


def task_on_subworlds(n_blocks: int) -> dict:
    """Two pipelines at once on a 4-rank world: 1F1B (m=4) on world ranks (3, 1) as pp ranks
    (0, 1), GPipe (m=2) on (0, 2). Every rank forms both pairs and builds both meshes; each pair
    trains its own. Then ranks (0, 1, 2) alone build a pp=3 mesh whose first and last stages
    tie the embedding (a tied group over ranks 0 and 2, formed by them on first use), and
    train it; rank 3 never builds it."""
    world = shardwise.comm.current()
    pairs = [world.new_group([3, 1], name="pair-a"), world.new_group([0, 2], name="pair-b")]
    meshes = [shardwise.Mesh(pp=2, dp=1, world=g) for g in pairs]
    which = 0 if world.rank in (1, 3) else 1
    mesh = meshes[which]
    schedule, m = ("1f1b", 4) if which == 0 else ("gpipe", 2)
    shardwise.comm_stats(reset=True)
    pipe = PipelineModule(layers(n_blocks), lm_loss, mesh, seed=SEED)
    loss = PipelineExecutor(pipe, schedule, microbatches=m).train_batch(*batch(8))
    out = {
        "pp": mesh.rank("pp"),
        "loss": loss.item(),
        "grads": grads_of(pipe),
        "stats": shardwise.comm_stats(),
    }
    if world.rank < 3:
        three = shardwise.Mesh(
            pp=3, dp=1, world=world.group_on_use([0, 1, 2], "three", world.stats)
        )
        pipe3 = PipelineModule(layers(n_blocks), lm_loss, three, "uniform", seed=SEED)
        loss3 = PipelineExecutor(pipe3, "gpipe", microbatches=2).train_batch(*batch(8))
        out["three"] = {"loss": loss3.item(), "grads": grads_of(pipe3)}
    return out

"""Parameters without a gradient follow torch: no update where no rank used them, the average
where some ranks did, accumulation over the micro-steps that used them.

The model has a branch used only on odd steps (or micro-steps), a layer never called, and a
mixture of experts routed differently on each rank with one expert never routed. Compared with
DistributedDataParallel(find_unused_parameters=True) on the same shards, and with one process for
gradient accumulation; the never-used parameters must be bitwise unchanged after 5 AdamW steps
with weight decay.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.testing import run_on_ranks

D, STEPS = 8, 5
NEVER = ("never.", "moe.experts.2.")


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, 3, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        choice = (x[:, 0] > 0).long()  # expert 0 or 1 by the input's sign; expert 2 never
        gate = torch.softmax(self.router(h), -1).gather(1, choice[:, None])
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if bool(mask.any()):
                out[mask] = expert(h[mask]) * gate[mask]
        return out


class Conditional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.branch = nn.Linear(D, D)
        self.never = nn.Linear(D, D)
        self.moe = MoE()
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        h = h + self.moe(h, x)
        return F.mse_loss(self.out(h), y)


def make() -> nn.Module:
    torch.manual_seed(0)
    return Conditional()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)


def batch(step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Part 0 routes every token to expert 0, part 1 to expert 1, others to both."""
    g = torch.Generator().manual_seed(100 * step + part)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)
    if part in (0, 1):
        x[:, 0] = x[:, 0].abs() * (1 if part == 1 else -1)
    return x, y


def _norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _task(stage: int, accum: int):
    torch.set_num_threads(1)
    rank = shardwise.rank()
    model = make()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ddp_model = copy.deepcopy(model)
    cfg = shardwise.Config(
        zero_stage=stage, gradient_accumulation_steps=accum, reduce_bucket_bytes=256
    )
    engine = shardwise.initialize(model, optimizer(model), cfg)
    norms = []
    for step in range(STEPS):
        for a in range(accum):
            use = (step * accum + a) % 2 == 1
            engine.backward(engine(*batch(step, rank * accum + a), use))
        engine.step()
        norms.append(engine.grad_norm)
    ddp_state, ddp_norms = None, []
    if accum == 1:
        ddp = nn.parallel.DistributedDataParallel(ddp_model, find_unused_parameters=True)
        opt = optimizer(ddp)
        for step in range(STEPS):
            ddp(*batch(step, rank), step % 2 == 1).backward()
            ddp_norms.append(_norm(ddp))
            opt.step()
            opt.zero_grad()
        dist.barrier()
        ddp_state = ddp.module.state_dict()
    return initial, engine.state_dict(), norms, ddp_state, ddp_norms


def reference(world: int, accum: int) -> tuple[dict, list[float]]:
    model = make()
    opt = optimizer(model)
    norms = []
    for step in range(STEPS):
        parts = world * accum
        for part in range(parts):
            use = (step * accum + part % accum) % 2 == 1
            (model(*batch(step, part), use) / parts).backward()
        norms.append(_norm(model))
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


def _check(state: dict, ref: dict, initial: dict) -> None:
    for k, v in ref.items():
        torch.testing.assert_close(
            state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}"
        )
        if k.startswith(NEVER):
            assert torch.equal(state[k], initial[k]), f"{k} changed but no rank ever used it"
        else:
            assert not torch.equal(state[k], initial[k]), f"{k} was used but not updated"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_parameters_match_ddp(world, stage):
    for initial, state, norms, ddp_state, ddp_norms in run_on_ranks(world, _task, stage, 1):
        _check(ddp_state, ddp_state, initial)  # DDP itself leaves the never-used ones alone
        _check(state, ddp_state, initial)
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(ddp_norms), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_used_in_some_micro_steps_accumulate(world, stage):
    ref, ref_norms = reference(world, 2)
    for initial, state, norms, _, _ in run_on_ranks(world, _task, stage, 2):
        _check(state, ref, initial)
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6
        )

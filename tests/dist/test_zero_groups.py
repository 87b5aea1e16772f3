"""ZeRO groups its flat buffers by each parameter's data-parallel group.

World 4 as ``Mesh(dp_shard=2, cp=2)``, every rank on its own batch (ZeRO treats cp ranks as
data-parallel ranks). A hand-made placement splits ``mix.expert`` (full shape [2, 16, 4])
along cp: cp rank c holds expert c, an expert-parallel layout in miniature. Every other
parameter is replicated along both dp axes, so ZeRO shards it over all 4 ranks; the expert is
replicated along dp_shard only, so its flat buffers shard over that 2-rank group, and its
gradient is the mean over the two ranks that ran it. The one-process reference trains the
whole model on the four batches (rank (d, c) through expert c) with that convention: the loss
averaged over the four ranks, the expert's gradient doubled (the mean over its 2 ranks, not
over 4). Loss, global gradient norm (clipping active), weights and a checkpoint round trip
must match it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.checkpoint import CheckpointReader
from shardwise.parallel.placement import Placement, Shard
from shardwise.testing import run_on_ranks

STEPS, CLIP, EXPERTS = 4, 0.05, 2
RTOL, ATOL = 1e-5, 1e-6


class Mix(nn.Module):
    """A shared bias and this rank's experts (one module: at stage 3 one unit, two groups)."""

    def __init__(self, experts: slice) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.2, 4))
        self.expert = nn.Parameter(torch.randn(EXPERTS, 16, 4)[experts].clone() * 0.3)


class Routed(nn.Module):
    def __init__(self, experts: slice) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.mix = Mix(experts)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, expert: int = 0) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        out = self.head(h) + h @ self.mix.expert[expert] + self.mix.bias
        return nn.functional.mse_loss(out, y)


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g))
             for _ in range(4)] for _ in range(STEPS)]


def _reference():
    model = Routed(slice(0, EXPERTS))
    opt = _opt(model)
    losses, norms = [], []
    for parts in _batches():
        step = []
        for r, (x, y) in enumerate(parts):
            loss = model(x, y, expert=r % EXPERTS)  # rank r = (dp_shard r // 2, cp r % 2)
            (loss / len(parts)).backward()
            step.append(float(loss.detach()))
        model.mix.expert.grad *= len(parts) // EXPERTS  # each expert: mean over its 2 ranks
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(step)
    return {k: v.clone() for k, v in model.state_dict().items()}, losses, norms


def _engine(stage: int):
    mesh = shardwise.Mesh(dp_shard=2, cp=2)
    c = mesh.rank("cp")
    model = Routed(slice(c, c + 1))
    where = {"mix.expert": Placement.on(mesh, "mix.expert", (EXPERTS, 16, 4), {"cp": Shard(0)})}
    cfg = shardwise.Config(zero_stage=stage, gradient_clipping=CLIP, reduce_bucket_bytes=256)
    engine = shardwise.initialize(model, _opt(model), cfg, group=mesh, placements=where)
    return engine, mesh


def _train_task(stage: int, load_stage: int, root: str):
    torch.set_num_threads(1)
    engine, mesh = _engine(stage)
    me = shardwise.rank()
    losses, norms = [], []
    for parts in _batches():
        x, y = parts[me]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        norms.append(engine.grad_norm)
    groups = [(list(f.names), list(f.group.ranks)) for f in engine.flats]
    expert_group = list(engine.placements.zero_group(engine.module.mix.expert).ranks)
    state = engine.state_dict()
    engine.save(root)
    other, _ = _engine(load_stage)
    other.load(root)
    return losses, norms, groups, expert_group, state, other.state_dict(), mesh.rank("dp_shard")


@pytest.mark.parametrize(("stage", "load_stage"), [(0, 3), (1, 2), (2, 1), (3, 0)])
def test_a_parameter_split_along_a_dp_axis_shards_over_the_other(tmp_path, stage, load_stage):
    ref_state, ref_losses, ref_norms = _reference()
    assert all(n > CLIP for n in ref_norms), "clipping must be active"
    root = str(tmp_path / "ckpt")
    results = run_on_ranks(4, _train_task, stage, load_stage, root)
    for rank, (losses, norms, groups, expert_group, state, loaded, d) in enumerate(results):
        assert d == rank // 2
        dp_shard = [rank % 2, rank % 2 + 2]  # the ranks holding the same expert
        assert expert_group == dp_shard
        assert sorted(n for names, _ in groups for n in names) == sorted(ref_state)
        for names, ranks in groups:
            experts = ["expert" in n for n in names]
            assert all(experts) or not any(experts), names  # a buffer holds one group
            assert ranks == (dp_shard if experts[0] else [0, 1, 2, 3]), names
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(
            [step[rank] for step in ref_losses]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms),
                                   rtol=RTOL, atol=ATOL)
        for k in ref_state:  # the whole expert gathered along cp
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"{k}: {m}")
            torch.testing.assert_close(loaded[k], state[k], rtol=0, atol=0)
    with CheckpointReader(tmp_path / "ckpt" / f"step-{STEPS:08d}") as reader:
        saved = reader.read_full("model/mix.expert")
    torch.testing.assert_close(saved, ref_state["mix.expert"], rtol=RTOL, atol=ATOL)

"""ZeRO-3 refuses, naming what to change, where it cannot be exact; elsewhere it is exact.

- Units called on some ranks only (experts made units of their own, routed differently per rank):
  the ranks' all_gathers pair different units; the step raises before updating anything.
And where it can be exact it is: a unit reading another unit's parameter through a plain
reference, first in the second step, gets it gathered and trains like one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_zero_unused import batch, make, optimizer
from torch import nn

import shardwise
from shardwise.testing import run_on_ranks


def _divergent_task():
    torch.set_num_threads(1)
    model = make()
    cfg = shardwise.Config(zero_stage=3, wrap_policy=["Linear"])
    engine = shardwise.initialize(model, optimizer(model), cfg)
    before = engine.state_dict()
    engine.backward(engine(*batch(0, shardwise.rank()), False))
    try:
        engine.step()
    except RuntimeError as e:
        return str(e), before, engine.state_dict()
    return None, before, engine.state_dict()


def test_units_called_on_some_ranks_only_are_refused_before_the_update():
    for rank, (error, before, after) in enumerate(run_on_ranks(2, _divergent_task)):
        assert error is not None and "gathered different units" in error
        assert f"moe.experts.{rank}" in error, error  # part r routes to expert r
        assert "wrap_policy" in error
        for k, v in before.items():
            assert torch.equal(after[k], v), k


class Peer(nn.Module):
    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self._other = [other]  # a reference, not a submodule

    def forward(self, h: torch.Tensor, borrow: bool) -> torch.Tensor:
        h = self.fc(h)
        return F.linear(h, self._other[0].weight) if borrow else h


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = Peer(self.a)


class Unseen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()

    def forward(self, x: torch.Tensor, borrow: bool) -> torch.Tensor:
        return self.pair.b(self.pair.a(x), borrow).square().mean()


def _late_borrow(model_or_engine, x: torch.Tensor, opt) -> list[float]:
    """Step 1 without the borrowed weight, steps 2-3 with it."""
    losses = []
    for borrow in (False, True, True):
        loss = model_or_engine(x, borrow)
        losses.append(loss.item())
        if opt is None:
            model_or_engine.backward(loss)
            model_or_engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses


def _late_task():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Unseen()
    cfg = shardwise.Config(zero_stage=3, wrap_policy=["Linear", "Peer"])
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    losses = _late_borrow(
        engine, torch.randn(2, 4, generator=torch.Generator().manual_seed(3)), None
    )
    return losses, engine.state_dict()


def test_a_use_of_another_units_parameter_first_seen_later_is_gathered():
    torch.manual_seed(0)
    model = Unseen()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = _late_borrow(model, torch.randn(2, 4, generator=torch.Generator().manual_seed(3)), opt)
    for losses, state in run_on_ranks(2, _late_task):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)

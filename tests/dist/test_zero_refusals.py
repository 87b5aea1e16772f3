"""ZeRO-3 refuses, naming what to change, where it cannot be exact.

- Units called on some ranks only (experts made units of their own, routed differently per rank):
  the ranks' all_gathers pair different units; the step raises before updating anything.
- A unit reading another unit's parameter in a way first seen after the first forward pass: torch
  fails on the sharded storage, and the error carries the parameter, the unit and the wrap policy.
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


def _unseen_task():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Unseen()
    cfg = shardwise.Config(zero_stage=3, wrap_policy=["Linear", "Peer"])
    engine = shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    x = torch.randn(2, 4)
    engine.backward(engine(x, False))  # the first pass: no borrowed weight to learn
    engine.step()
    try:
        engine(x, True)
    except RuntimeError as e:
        return "\n".join(getattr(e, "__notes__", []))
    return None


def test_unseen_use_of_another_units_parameter_names_it_and_the_wrap_policy():
    for note in run_on_ranks(2, _unseen_task):
        assert note is not None
        assert "pair.a.weight" in note and "'pair.b'" in note
        assert "wrap_policy=['Pair']" in note

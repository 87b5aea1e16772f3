"""The phase of a module call: FORWARD, or RECOMPUTE when autograd runs it inside backward."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.recompute import apply_activation_checkpointing
from shardwise.zero.param_schedule import Phase, call_phase


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.seen: list[Phase] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(call_phase())
        return torch.tanh(self.fc(x))


def test_forward_then_recompute_inside_backward():
    model = Probe()
    apply_activation_checkpointing(model, ["Probe"])
    model(torch.randn(2, 3)).sum().backward()
    assert model.seen == [Phase.FORWARD, Phase.RECOMPUTE]
    assert call_phase() is Phase.FORWARD


def test_a_forward_run_by_a_backward_hook_is_not_forward():
    model = Probe()
    x = torch.randn(2, 3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: model(g) * 0 + g)
    y.sum().backward()
    assert model.seen == [Phase.RECOMPUTE]

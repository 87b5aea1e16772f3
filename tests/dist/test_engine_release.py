"""A dropped engine frees its model: nothing it registered keeps the parameters alive.

Gradient hooks live in each parameter's C++ autograd metadata, out of sight of Python's cycle
collector; a hook holding its engine strongly kept every flat buffer and parameter of every
engine ever built in the process (about 7 MB per small engine, 12 GB per rank over the 400
layouts ``benchmarks/auto_plan.py`` screens).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import shardwise
from shardwise.testing import run_on_ranks
from shardwise.zero.flat_param import FlatParam


def _flat_buffers() -> int:
    gc.collect()
    return sum(isinstance(o, FlatParam) for o in gc.get_objects())


def _task(stage: int) -> tuple[bool, bool, int]:
    torch.set_num_threads(1)
    # the rank processes are shared with other tests: count only what this engine leaves behind
    before = _flat_buffers()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    engine = shardwise.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), shardwise.Config(zero_stage=stage)
    )
    x = torch.randn(4, 8)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    weight, eng = weakref.ref(model[0].weight), weakref.ref(engine)
    del model, engine
    left = _flat_buffers() - before  # collects first: the weak references are read after
    return eng() is None, weight() is None, left


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_engine_frees_its_parameters_and_buffers(stage):
    # its own rank processes: what other tests leave in the shared ones is not this engine's
    for engine_gone, weight_gone, flats in run_on_ranks(2, _task, stage, fresh=True):
        assert engine_gone
        assert weight_gone, "a parameter outlived its engine"
        assert flats == 0, f"{flats} flat buffers outlived their engine"

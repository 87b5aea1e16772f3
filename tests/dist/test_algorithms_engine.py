"""The engine's stage-0 gradient all_reduce by a chosen algorithm: the same training as native
(to fp32 rounding), with the algorithm's messages in comm_stats."""

from __future__ import annotations

import os

import pytest
import torch
from zero_cases import batches, make_gpt, make_optimizer

import shardwise
from shardwise.comm import emulate
from shardwise.testing import run_on_ranks


def _train(algorithm: str, nodes: str) -> tuple[list[float], dict, int]:
    os.environ[emulate.NODES_ENV] = nodes
    try:
        torch.set_num_threads(1)
        world, rank = shardwise.world_size(), shardwise.rank()
        model = make_gpt()
        cfg = shardwise.Config(allreduce_algorithm=algorithm, reduce_bucket_bytes=4096)
        engine = shardwise.initialize(model, make_optimizer(model, "adamw"), cfg)
        shardwise.comm_stats(reset=True)
        losses = []
        for parts in batches("gpt", 3, world):
            x, y = parts[rank]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        sent = shardwise.comm_stats().get("send", {}).get("bytes", 0)
        return losses, engine.state_dict(), sent
    finally:
        os.environ.pop(emulate.NODES_ENV, None)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "hierarchical", "auto"])
def test_engine_trains_alike_with_every_algorithm(algorithm):
    nodes = "0,0,1,1"
    native = run_on_ranks(4, _train, "native", nodes, timeout_s=600)
    other = run_on_ranks(4, _train, algorithm, nodes, timeout_s=600)
    for (l0, s0, sent0), (l1, s1, sent1) in zip(native, other):
        assert sent0 == 0 and sent1 > 0  # the gradients went through the algorithm's messages
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=1e-5, atol=1e-6)
        for k in s0:
            torch.testing.assert_close(s1[k], s0[k], rtol=1e-5, atol=1e-6)
    # every rank holds the same parameters (each element reduced once, then copied)
    assert all(torch.equal(o[1][k], other[0][1][k]) for o in other for k in o[1])


def test_algorithm_only_for_stage_0():
    with pytest.raises(ValueError, match="applies to zero_stage=0"):
        shardwise.Config(zero_stage=2, allreduce_algorithm="ring")

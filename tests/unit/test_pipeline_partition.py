"""Stage partitioning and layer specs (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.parallel.pipeline.partition import balanced_bounds, partition_layers
from shardwise.parallel.pipeline.stage import LayerFn, LayerSpec, Tied


def test_parameters_partition_balances_counts() -> None:
    # a heavy embedding first: it gets a stage to itself
    assert partition_layers([100, 10, 10, 10, 10, 100], 2, "parameters") == [0, 3, 6]
    assert partition_layers([100, 10, 10, 10, 10, 100], 3, "parameters") == [0, 1, 5, 6]
    assert partition_layers([0, 0, 0, 0], 2, "parameters") == [0, 2, 4]  # no parameters: even


def test_uniform_partition_and_uneven_split() -> None:
    assert partition_layers([5] * 7, 3, "uniform") == [0, 2, 4, 7]  # ties: earliest cuts
    assert partition_layers([1, 1000, 1], 3, "uniform") == [0, 1, 2, 3]


def test_balanced_bounds_is_optimal() -> None:
    import itertools

    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    for parts in range(1, 6):
        bounds = balanced_bounds(costs, parts)
        best = min(
            max(sum(costs[a:b]) for a, b in itertools.pairwise([0, *cuts, len(costs)]))
            for cuts in itertools.combinations(range(1, len(costs)), parts - 1)
        )
        assert max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)) == best


def test_explicit_cuts_and_bad_partitions() -> None:
    assert partition_layers([1] * 5, 3, [1, 4]) == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="needs 2 cut indices for 3 stages, got 1"):
        partition_layers([1] * 5, 3, [2])
    with pytest.raises(ValueError, match=r"must increase strictly within 1\.\.4"):
        partition_layers([1] * 5, 3, [3, 3])
    with pytest.raises(ValueError, match="unknown partition 'layers'; allowed: parameters"):
        partition_layers([1] * 5, 2, "layers")
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        partition_layers([1] * 3, 4, "uniform")
    with pytest.raises(TypeError, match="cut indices must be ints"):
        partition_layers([1] * 3, 2, [1.5])


def test_layer_spec_builds_lazily_and_reproducibly() -> None:
    spec = LayerSpec(nn.Linear, 4, 3, bias=False)
    assert spec.count_parameters() == 12
    state = torch.random.get_rng_state()
    a, b = spec.build(seed=7), spec.build(seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    assert torch.equal(a.weight, b.weight) and a.weight.shape == (3, 4)
    with pytest.raises(TypeError, match="not a Module"):
        LayerSpec(lambda: 3).build()
    with pytest.raises(TypeError, match="needs a module or LayerSpec"):
        Tied("emb", 3)  # type: ignore[arg-type]


def test_layer_fn_owns_its_modules() -> None:
    emb = nn.Embedding(5, 2)
    layer = LayerFn(lambda m, x: x + m.pos(torch.arange(x.shape[0])), pos=emb)
    assert [n for n, _ in layer.named_parameters()] == ["pos.weight"]
    assert torch.equal(layer(torch.zeros(3, 2)), emb.weight[:3])

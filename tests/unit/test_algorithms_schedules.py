"""All-reduce schedules as data: every schedule reduces correctly (played in one process), and
its predicted time equals the closed-form alpha-beta cost of the algorithm."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.comm.allreduce_rounds import GroupLinks, LinkCost, choose, predict_seconds, schedule


def _play(alg: str, n: int, nodes: tuple[int, ...]) -> list[torch.Tensor]:
    p = len(nodes)
    g = torch.Generator().manual_seed(p * 1000 + n)
    xs = [torch.randint(-1000, 1000, (n,), generator=g) for _ in range(p)]
    bufs = [x.clone() for x in xs]
    for rnd in schedule(alg, n, p, nodes):
        srcs = [t.src for t in rnd]
        dsts = [t.dst for t in rnd]
        assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
        msgs = [(t, bufs[t.src][t.lo : t.hi].clone()) for t in rnd]
        for t, m in msgs:
            if t.reduce:
                bufs[t.dst][t.lo : t.hi] += m
            else:
                bufs[t.dst][t.lo : t.hi] = m
    ref = torch.stack(xs).sum(0)
    return [b - ref for b in bufs]


@pytest.mark.parametrize("alg", ["ring", "halving_doubling", "tree"])
@pytest.mark.parametrize("p", range(1, 10))
def test_flat_schedules_reduce_everything_everywhere(alg, p):
    for n in (0, 1, 2, 3, 7, 8, 17, 100):
        assert all(not d.any() for d in _play(alg, n, tuple(range(p))))


@pytest.mark.parametrize(
    "nodes", [(0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 2, 3, 3), (7, 7)]
)
def test_hierarchical_schedule_reduces_everything_everywhere(nodes):
    for n in (0, 1, 3, 7, 100):
        assert all(not d.any() for d in _play("hierarchical", n, nodes))


def test_hierarchical_needs_even_nodes():
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        schedule("hierarchical", 10, 3, (0, 0, 1))
    with pytest.raises(ValueError, match="allowed"):
        schedule("butterfly", 10, 3)


A, B = 2e-4, 1e-9  # alpha (s), beta (s/byte)
A_OUT, B_OUT = 1e-3, 1e-8


def _links(n_nodes: int, per_node: int) -> GroupLinks:
    nodes = tuple(r // per_node for r in range(n_nodes * per_node))
    return GroupLinks(nodes, LinkCost(A, B), LinkCost(A_OUT, B_OUT))


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_flat_costs_match_closed_forms_on_one_node(p):
    n = 4 * 720720 * 4  # bytes; elements divisible by every p here
    links = _links(1, p)
    log = math.log2(p)
    assert predict_seconds("ring", n, 4, links) == pytest.approx(2 * (p - 1) * (A + n / p * B))
    hd = 2 * log * A + 2 * (p - 1) / p * n * B
    assert predict_seconds("halving_doubling", n, 4, links) == pytest.approx(hd)
    assert predict_seconds("tree", n, 4, links) == pytest.approx(2 * log * (A + n * B))


def test_halving_doubling_folds_extra_ranks():
    n, p = 4 * 720720 * 4, 6  # P = 4, two extra ranks: one fold and one unfold round of n
    fold = 2 * (A + n * B)
    core = 2 * 2 * A + 2 * 3 / 4 * n * B
    assert predict_seconds("halving_doubling", n, 4, _links(1, p)) == pytest.approx(fold + core)


@pytest.mark.parametrize("n_nodes,per_node", [(2, 2), (2, 4), (4, 8)])
def test_two_level_cost_matches_the_closed_form(n_nodes, per_node):
    n = 4 * 720720 * 4  # elements divisible by 64
    g, m = per_node, n_nodes
    intra = 2 * (g - 1) * (A + n / g * B)
    inter = 2 * (m - 1) * (A_OUT + n / (g * m) * B_OUT)
    links = _links(n_nodes, per_node)
    assert predict_seconds("hierarchical", n, 4, links) == pytest.approx(intra + inter)
    # the flat ring crosses the slow link at every round
    ring = 2 * (m * g - 1) * (A_OUT + n / (m * g) * B_OUT)
    assert predict_seconds("ring", n, 4, links) == pytest.approx(ring)


def test_choose_follows_the_size():
    links = _links(2, 4)
    assert choose(4, 4, links) in ("tree", "halving_doubling")  # latency-bound: log rounds
    assert choose(64 << 20, 4, links) == "hierarchical"  # bandwidth-bound over a slow link
    one_node = _links(1, 8)
    assert choose(64 << 20, 4, one_node) in ("ring", "halving_doubling")

"""Calibrating the cost model: fitted ring steps and links recover the alpha-beta that made the
times, half-duplex links add a rank's sent and received bytes, measured hardware that does not
overlap exposes all communication, and pipelines price their busiest stage."""

from __future__ import annotations

import pytest

from shardwise.comm.allreduce_rounds import GroupLinks, LinkCost, predict_seconds
from shardwise.costmodel import Plan, hardware, measured, predict, ring_seconds, shape
from shardwise.costmodel.calibrate import fit_ring_step, fit_schedule_link, ring_steps
from shardwise.topology.model import LinkFit, RankInfo, Topology

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_a_ring_step_fit_recovers_alpha_and_beta(op, n):
    truth = LinkCost(3e-4, 7e-10)
    seconds = [ring_seconds(truth, s, n, op) for s in SIZES]
    fit = fit_ring_step(op, n, SIZES, seconds)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=1e-9)
    assert ring_steps(op, n) == (2 * (n - 1) if op == "all_reduce" else n - 1)


def test_a_fit_never_goes_negative():
    # times that fall with size would need a negative beta: latency only instead
    fit = fit_ring_step("all_reduce", 2, [1 << 20, 2 << 20], [2e-3, 1.9e-3])
    assert fit.beta_s_per_byte == 0 and fit.alpha_s > 0
    # times through the origin and below: bandwidth only
    fit = fit_ring_step("all_reduce", 2, [1 << 20, 2 << 20], [1e-3, 2.5e-3])
    assert fit.alpha_s == 0 and fit.beta_s_per_byte > 0


def test_bad_fits_are_refused():
    with pytest.raises(ValueError, match="two or more different sizes"):
        fit_ring_step("all_reduce", 2, [1 << 20], [1e-3])
    with pytest.raises(ValueError, match="n >= 2"):
        fit_ring_step("all_reduce", 1, SIZES, [1e-3] * 4)
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        ring_steps("gather", 4)
    with pytest.raises(ValueError, match="must be > 0"):
        fit_ring_step("all_gather", 2, SIZES, [0.0, 1e-3, 2e-3, 3e-3])


@pytest.mark.parametrize("alg", ["ring", "halving_doubling", "tree"])
@pytest.mark.parametrize("duplex", [True, False])
def test_a_schedule_link_fit_recovers_the_link(alg, duplex):
    truth = LinkCost(2e-4, 5e-10, duplex)
    links = GroupLinks((0,) * 4, truth, truth)
    seconds = [predict_seconds(alg, s, 4, links) for s in SIZES]
    fit = fit_schedule_link(alg, 4, SIZES, seconds, duplex)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=1e-9)
    assert fit.duplex is duplex


def test_half_duplex_links_add_what_a_rank_sends_and_receives():
    a, b, n = 1e-4, 1e-9, 8 << 20
    full = GroupLinks((0, 0), LinkCost(a, b), LinkCost(a, b))
    half = GroupLinks((0, 0), LinkCost(a, b, False), LinkCost(a, b, False))
    # 2 ranks: the ring's two rounds each send n/2 and receive n/2 on every rank; half-duplex,
    # a rank handles the two messages in turn (two latencies, n bytes)
    assert predict_seconds("ring", n, 4, full) == pytest.approx(2 * (a + n / 2 * b))
    assert predict_seconds("ring", n, 4, half) == pytest.approx(2 * (2 * a + n * b))
    # the tree's rounds go one way (n bytes out of one rank, into the other): the same either way
    assert predict_seconds("tree", n, 4, half) == pytest.approx(predict_seconds("tree", n, 4, full))


def _topology(device: str) -> Topology:
    ranks = tuple(RankInfo(r, "n0", "h", r, (r,), (), device) for r in range(2))
    fit = LinkFit(1e-4, 1e-9, 0.99)
    return Topology(ranks, (1024,), ((None, fit), (fit, None)), ((None, (1.0,)), ((1.0,), None)))


def test_cpu_processes_of_one_node_have_a_half_duplex_link():
    assert _topology("cpu").links().intra.duplex is False
    assert _topology("cuda:0").links().intra.duplex is True


def test_without_overlap_all_data_parallel_communication_is_exposed():
    m = shape("anchor")
    links = (LinkCost(2e-4, 1e-9), LinkCost(2e-4, 1e-9))
    over = measured(links, 8, 5e10, 1 << 40, 2e10)
    no = measured(links, 8, 5e10, 1 << 40, 2e10, overlap=False)
    plan = Plan(dp=2, micro_batch=2, precision="fp32")
    grads = m.params() * 4
    assert predict(m, plan, no).breakdown["dp"] == pytest.approx(ring_seconds(links[0], grads, 2))
    assert predict(m, plan, over).breakdown["dp"] < predict(m, plan, no).breakdown["dp"]


def test_fitted_collectives_replace_the_link_inside_a_node_only():
    links = (LinkCost(2e-4, 1e-9), LinkCost(1e-3, 1e-8))
    ag = LinkCost(5e-4, 3e-9)
    hw = measured(links, 2, 5e10, 1 << 40, 2e10, collectives={"all_gather": ag})
    assert hw.collective_link("all_gather", 1, 2) == ag
    assert hw.collective_link("all_reduce", 1, 2) == links[0]  # not fitted: the link
    assert hw.collective_link("all_gather", 1, 4) == links[1]  # spans two nodes
    m = shape("anchor")
    plan = Plan(dp=2, micro_batch=2, zero_stage=3, precision="fp32", dp_overlap=False)
    params = m.params()
    expected = ring_seconds(links[0], params * 4, 2, "reduce_scatter") + 2 * ring_seconds(
        ag, params * 4, 2, "all_gather"
    )
    assert predict(m, plan, hw).breakdown["dp"] == pytest.approx(expected)


def test_a_pipeline_runs_at_its_busiest_stage():
    m, hw = shape("anchor"), hardware("h100x8-ib")
    even = Plan(pp=2, micro_batches=4, precision="fp32", stage_layers=(3, 3))
    # the last stage also runs the output head: moving a layer off it balances the pipeline
    lighter = Plan(pp=2, micro_batches=4, precision="fp32", stage_layers=(4, 2))
    assert predict(m, lighter, hw).step_s < predict(m, even, hw).step_s
    # 1F1B: m times the busiest stage's micro-batch, plus the other stages' fill and drain
    p = predict(m, even, hw).breakdown
    one = predict(m, Plan(pp=2, micro_batches=1, precision="fp32", stage_layers=(3, 3)), hw)
    last = p["compute"] / 4
    assert one.breakdown["compute"] == pytest.approx(last)
    assert p["bubble"] == pytest.approx(one.breakdown["bubble"])
    assert p["bubble"] < last  # the first stage, without the head, is the lighter one
    # the FLOPs of the step do not depend on the split
    assert predict(m, lighter, hw).hardware_flops_per_step == pytest.approx(
        predict(m, even, hw).hardware_flops_per_step
    )


def test_bad_stage_layers_are_refused():
    with pytest.raises(ValueError, match="one layer count >= 0 per pipeline rank"):
        Plan(pp=2, stage_layers=(6,))
    with pytest.raises(ValueError, match=r"sum to 5, but the model has 6 layers"):
        predict(shape("anchor"), Plan(pp=2, stage_layers=(3, 2)), hardware("h100x8-ib"))


def test_sync_loss_is_paid_where_ranks_meet_through_the_step():
    m = shape("anchor")
    links = (LinkCost(2e-4, 1e-9), LinkCost(2e-4, 1e-9))
    base = measured(links, 8, 5e10, 1 << 40, 2e10, overlap=False)
    lossy = measured(links, 8, 5e10, 1 << 40, 2e10, overlap=False, sync_loss=0.1)
    tp = Plan(tp=2, micro_batch=4, precision="fp32")
    pp = Plan(pp=2, micro_batches=4, precision="fp32")
    both = Plan(tp=2, pp=2, micro_batches=4, precision="fp32")
    for plan, term in ((tp, "tp"), (pp, "p2p"), (both, "tp")):
        a, b = predict(m, plan, base).breakdown, predict(m, plan, lossy).breakdown
        # the compute of the step (busiest pipeline rank) times the loss, counted once
        assert b[term] - a[term] == pytest.approx(0.1 * a["compute"])
        assert sum(b.values()) - sum(a.values()) == pytest.approx(0.1 * a["compute"])
    dp = Plan(dp=2, micro_batch=2, precision="fp32")  # meets once a step: in the calibration
    assert predict(m, dp, lossy).step_s == predict(m, dp, base).step_s
    with pytest.raises(ValueError, match="sync_loss"):
        measured(links, 8, 5e10, 1 << 40, 2e10, sync_loss=1.0)
    with pytest.raises(ValueError, match="sync_loss"):
        measured(links, 8, 5e10, 1 << 40, 2e10, sync_loss=-0.1)

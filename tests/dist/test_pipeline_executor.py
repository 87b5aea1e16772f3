"""The pipeline executor on real gloo ranks against one process."""

from __future__ import annotations

import os
import time

import pipeline_cases as pc
import pytest
import torch

from shardwise.parallel.pipeline import SCHEDULES, build_schedule, schedule_from_compute, simulate
from shardwise.testing import RankError, RankPool, run_on_ranks

N_BLOCKS = 6  # 8 layers: enough for pp=4 with 2 virtual stages
BATCH_ELEMS = 8 * pc.SEQ * pc.DIM  # one boundary tensor of the whole batch
META_BYTES = 10 * 8  # the shape message per boundary per step
PG_TIMEOUT_S = 8


def _reference(batch_seed: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    ref = pc.Reference(N_BLOCKS)
    x, y = pc.batch(8, batch_seed)
    loss = ref(x, y)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in ref.named_like_pipeline().items()}


def _configs(p: int) -> list[tuple[str, int, int]]:
    out = []
    for m in (1, p, 2 * p, 8):
        out += [(s, m, 1) for s in SCHEDULES if s != "interleaved_1f1b"]
        out.append(("interleaved_1f1b", m, 2))
    return out


def _p2p_bytes(p: int, v: int, rank: int) -> tuple[int, int]:
    """(sent, received) by ``rank`` in one step: an activation forward from every stage but the
    last (with one shape message), a gradient back from every stage but the first."""
    last = p * v - 1
    stages = range(rank, p * v, p)
    act, grad = BATCH_ELEMS * 4 + META_BYTES, BATCH_ELEMS * 4
    sent = sum(act for s in stages if s < last) + sum(grad for s in stages if s > 0)
    received = sum(act for s in stages if s > 0) + sum(grad for s in stages if s < last)
    return sent, received


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_matches_one_process(p: int) -> None:
    """Loss and gradients of one step equal the single-process whole-batch ones, for every
    schedule and m in {1, p, 2p, 8}; tied copies bitwise equal; exact send bytes."""
    want_loss, want = _reference()
    configs = _configs(p)
    results = run_on_ranks(p, pc.task_grads_many, configs, N_BLOCKS, timeout_s=600)
    grads_by_m: dict[int, dict[str, torch.Tensor]] = {}
    for i, (schedule, m, v) in enumerate(configs):
        per_rank = [results[r][i] for r in range(p)]
        if schedule == "interleaved_1f1b" and m % p:
            assert all("divisible by the pp size" in out["refused"] for out in per_rank)
            continue
        for r, out in enumerate(per_rank):
            assert out["loss"] == pytest.approx(want_loss, rel=1e-6), (schedule, m, r)
            for k, g in out["grads"].items():
                torch.testing.assert_close(g, want[k], rtol=1e-5, atol=1e-6, msg=f"{k} {schedule}")
            sent, received = _p2p_bytes(p, v, r)
            assert (out["stats"]["send"]["bytes"], out["stats"]["recv"]["bytes"]) == (
                sent,
                received,
            )
        holders = [
            out["grads"]["tied.embed.weight"]
            for out in per_rank
            if out["grads"].get("tied.embed.weight") is not None
        ]
        assert len(holders) >= 2 and all(torch.equal(h, holders[0]) for h in holders)
        if schedule == "1f1b":
            grads_by_m[m] = {k: g for out in per_rank for k, g in out["grads"].items()}
    # micro-batch count does not change the gradients beyond the order of fp32 sums (m
    # micro-batch sums against one whole-batch sum; 1.6e-7 seen on an AVX2-only CPU)
    for k, g in grads_by_m[8].items():
        torch.testing.assert_close(grads_by_m[1][k], g, rtol=1e-6, atol=1e-6)
    assert set(grads_by_m[8]) == set(want)


def test_training_keeps_tied_copies_equal_and_accumulation_exact() -> None:
    """20 AdamW steps at pp=2: the embedding on stage 0 and the head on stage 1 stay bitwise
    equal, the weights match one process, accumulation 2 x m2 equals m4, tied saved once."""
    steps = 20
    ref = pc.Reference(N_BLOCKS)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ref_losses = []
    for step in range(steps):
        x, y = pc.batch(8, seed=step)
        opt.zero_grad()
        loss = ref(x, y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    want = {k: p.detach() for k, p in ref.named_like_pipeline().items()}
    plain = run_on_ranks(2, pc.task_steps, "1f1b", 4, N_BLOCKS, steps, 1)
    accum = run_on_ranks(2, pc.task_steps, "zb_h1", 2, N_BLOCKS, steps, 2)
    assert torch.equal(
        plain[0]["params"]["tied.embed.weight"], plain[1]["params"]["tied.embed.weight"]
    )
    assert torch.equal(
        accum[0]["params"]["tied.embed.weight"], accum[1]["params"]["tied.embed.weight"]
    )
    for r in range(2):
        assert plain[r]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for k, v in plain[r]["params"].items():
            # 20 AdamW steps amplify the order of fp32 sums (4 micro-batches against one batch)
            # in elements whose gradient is near zero: up to 4.6e-6 seen on an AVX2-only CPU
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-5, msg=k)
            torch.testing.assert_close(accum[r]["params"][k], v, rtol=1e-6, atol=1e-6, msg=k)
    assert "tied.embed.weight" in plain[0]["saved"]
    assert "tied.embed.weight" not in plain[1]["saved"]
    saved = {**plain[0]["saved"], **plain[1]["saved"]}
    assert set(saved) == set(want)


def _fail_late(fn, *args) -> None:  # type: ignore[no-untyped-def]
    """Run ``fn``; on an error of its own, wait past the peers' timeout before raising, so the
    pool collects every rank's error (it stops listening 5 s after the first)."""
    from shardwise.comm import CollectiveError

    try:
        fn(*args)
    except CollectiveError:
        raise  # a peer's failure seen here: report at once
    except Exception:
        time.sleep(PG_TIMEOUT_S + 3)
        raise


def _desync_task() -> None:
    """Rank 1 runs GPipe's backwards in reverse order, rank 0 the usual order: each schedule is
    valid alone, together they would silently pair rank 1's gradient of micro-batch 3 with
    rank 0's micro-batch 0. With headers on, rank 0 names both ranks instead."""
    import shardwise

    shardwise.comm.set_debug(True)
    mesh = shardwise.Mesh(pp=2, dp=1)
    pipe = pc.PipelineModule(pc.layers(N_BLOCKS), pc.lm_loss, mesh, seed=pc.SEED)
    compute = [
        [a for a in acts if a.kind.is_compute] for acts in build_schedule("gpipe", 2, 4).actions
    ]
    if shardwise.rank() == 1:
        compute[1] = compute[1][:4] + compute[1][4:][::-1]
    schedule = schedule_from_compute("gpipe", compute, 4)
    x, y = pc.batch(8)
    _fail_late(pc.PipelineExecutor(pipe, schedule).train_batch, x, y)


def _wrong_shape_task() -> None:
    """Stage 0's second micro-batch comes out a different shape."""
    import shardwise

    mesh = shardwise.Mesh(pp=2, dp=1)
    calls = []

    def trim(h: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return h[:, :-1] if len(calls) == 2 else h

    layers = pc.layers(N_BLOCKS)
    layers.insert(1, pc.LayerSpec(pc.Lambda, trim))
    pipe = pc.PipelineModule(layers, pc.lm_loss, mesh, [4], seed=pc.SEED)
    x, y = pc.batch(8)
    _fail_late(pc.PipelineExecutor(pipe, "1f1b", microbatches=4).train_batch, x, y)


@pytest.mark.parametrize(
    "task, first",
    [
        (_desync_task, "pipeline desync: rank 0 expected the gradient of stage 1, micro-batch 0"),
        pytest.param(  # in CI's long step
            _wrong_shape_task,
            "pipeline stage 0 output of micro-batch 1 is (2, 2, 8)",
            marks=pytest.mark.long,
        ),
    ],
)
def test_bad_messages_fail_on_every_rank(task, first: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDWISE_TRACE_DIR", str(tmp_path))
    pool = RankPool(2, pg_timeout_s=PG_TIMEOUT_S)
    try:
        with pytest.raises(RankError) as err:
            pool.run(task, timeout_s=90)
    finally:
        pool.close()
    text = str(err.value)
    assert first in text
    assert "rank 0 also failed" in text or "failed on rank 0" in text
    assert "CollectiveTimeoutError" in text  # the peer did not hang: its wait timed out
    assert sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.skipif(
    os.environ.get("SHARDWISE_TIMED_TESTS") != "1",
    reason="a wall-clock check: set SHARDWISE_TIMED_TESTS=1 on a quiet machine",
)
@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_sleeping_stages_take_the_simulated_time(schedule: str, v: int) -> None:
    """Stages sleep t_fwd / t_bwd per micro-batch instead of computing, so 4 ranks do not
    contend for the cores: the measured step is the simulated one within 10%. Wall-clock, so
    opt-in: on a machine loaded far beyond its cores every wake-up waits for a core."""
    p, m, t_f, t_b = 4, 4, 0.1, 0.2
    measured = max(run_on_ranks(p, pc.task_sleep, schedule, m, v, t_f, t_b, timeout_s=300))
    model = simulate(schedule, p, m, virtual_stages=v, t_fwd=t_f, t_bwd=t_b, t_wgrad=0)
    assert measured == pytest.approx(float(model.makespan), rel=0.10), (measured, model.makespan)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_dp2_pp2_mesh_matches_one_process(schedule: str) -> None:
    """Four ranks: each dp replica pipelines half the batch; gradients averaged over dp equal
    the whole batch's; every rank timed each of its compute actions."""
    want_loss, want = _reference()
    out = run_on_ranks(4, pc.task_grads_dp, schedule, 2, N_BLOCKS, timeout_s=300)
    per_stage = {0: set(), 1: set()}
    for r, res in enumerate(out):
        assert res["loss"] == pytest.approx(want_loss, rel=1e-6)
        for k, g in res["grads"].items():
            torch.testing.assert_close(g, want[k], rtol=1e-5, atol=1e-6, msg=f"rank {r} {k}")
        per_stage[res["coords"]["pp"]].update(res["grads"])
        assert res["computes"] == 2 * (3 if schedule == "zb_h1" else 2) and res["busy_le_wall"]
    assert per_stage[0] | per_stage[1] == set(want)

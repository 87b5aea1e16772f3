"""ZeRO memory and communication, asserted against the paper's formulas (fp32, Adam).

Ψ parameters over N ranks (ZeRO paper, section 5 and Figure 1, K = 8 for fp32 Adam states):
model states per rank are 16Ψ (stage 0), 8Ψ + 8Ψ/N (1), 4Ψ + 12Ψ/N (2), 16Ψ/N (3). Padding: each
flat buffer is rounded up to a multiple of N, so Ψ_pad = Σ padded sizes < Ψ + N per buffer.
Communication per step with one micro-step: all_reduce 4Ψ (0); reduce_scatter 4Ψ + all_gather
4Ψ (1-2); all_gather 8Ψ + reduce_scatter 4Ψ (3), at Ψ_pad; stages 1-3 add one 4-byte all_reduce
for the global gradient norm. Every stage adds one all_reduce of the "used" map, one byte per
trainable parameter tensor, that decides which parameters got a gradient on some rank; at stage 3
it carries 16 more bytes, a hash of the order in which buffers were gathered (and its complement)
that checks every rank gathered the same ones.
"""

from __future__ import annotations

import gc

import pytest
import torch
import zero_cases as zc

import shardwise
from shardwise.testing import run_on_ranks


def _live_tensor_bytes() -> int:
    """Every live tensor's storage, each storage once (an independent count)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            is_tensor = isinstance(obj, torch.Tensor)
        except Exception:
            continue
        if is_tensor and obj.device.type == "cpu":
            st = obj.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _memory_task(stage: int):
    torch.set_num_threads(1)
    n = shardwise.world_size()
    gc.collect()
    baseline = _live_tensor_bytes()
    model = zc.make_gpt()
    engine = shardwise.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        shardwise.Config(zero_stage=stage, reduce_bucket_bytes=8192),
    )
    psi = sum(p.numel() for p in model.parameters())
    psi_pad = sum(f.padded for f in engine.flats)
    data = zc.batches("gpt", 2, n)
    for step, parts in enumerate(data):
        x, y = parts[shardwise.rank()]
        engine.backward(engine(x, y))
        if step == 1:  # optimizer states exist from the first step on
            mem = engine.memory()
            del x, y
            gc.collect()
            walked = _live_tensor_bytes() - baseline
        engine.step()
    return psi, psi_pad, len(engine.flats), mem, walked


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_match_zero_formulas(world, stage):
    results = run_on_ranks(world, _memory_task, stage)
    psi, psi_pad, nflats = results[0][:3]
    assert psi_pad - psi < world * nflats  # padding: less than N elements per flat buffer
    n = world
    expected_params = {0: 4 * psi_pad, 1: 4 * psi_pad, 2: 4 * psi_pad, 3: 4 * psi_pad // n}
    expected_grads = {0: 4 * psi_pad, 1: 4 * psi_pad, 2: 4 * psi_pad // n, 3: 4 * psi_pad // n}
    optim_total = 0
    for _, _, _, mem, walked in results:
        assert mem["params"] == expected_params[stage]
        assert mem["grads"] == expected_grads[stage]
        assert mem["comm"] == 0  # after backward: no reduction in flight
        # Adam keeps exp_avg and exp_avg_sq for the elements this rank owns (no padding)
        if stage == 0:
            assert mem["optimizer"] == 8 * psi
        else:
            assert abs(mem["optimizer"] - 8 * psi / n) <= 8 * nflats * n
        optim_total += mem["optimizer"]
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        # the paper's figure, up to padding
        formula = {
            0: 16 * psi,
            1: 8 * psi + 8 * psi / n,
            2: 4 * psi + 12 * psi / n,
            3: 16 * psi / n,
        }[stage]
        assert abs(states - formula) <= 16 * nflats * n
        # the independent count: every live tensor this rank holds, minus what existed
        # before the model (a few scalars remain: Adam's step counters, the loss)
        assert 0 <= walked - states <= 4096 + 64 * nflats
    if stage > 0:
        assert optim_total == 8 * psi


def _comm_task(stage: int):
    torch.set_num_threads(1)
    n = shardwise.world_size()
    model = zc.make_gpt()
    engine = shardwise.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        shardwise.Config(zero_stage=stage, reduce_bucket_bytes=8192),
    )
    psi_pad = sum(f.padded for f in engine.flats)
    used_map = sum(len(f.params) for f in engine.flats if f.trainable)
    per_step = []
    for parts in zc.batches("gpt", 2, n):
        shardwise.comm_stats(reset=True)
        x, y = parts[shardwise.rank()]
        engine.backward(engine(x, y))
        engine.step()
        per_step.append(shardwise.comm_stats())
    return psi_pad, used_map, per_step


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_communication_bytes_exact(world, stage):
    for psi_pad, used_map, per_step in run_on_ranks(world, _comm_task, stage):
        for stats in per_step:  # the first step (no prefetch yet) and the second
            got = {op: s["bytes"] for op, s in stats.items()}
            if stage == 0:
                assert got == {"all_reduce": 4 * psi_pad + used_map}
            elif stage in (1, 2):
                assert got == {
                    "reduce_scatter": 4 * psi_pad,
                    "all_gather": 4 * psi_pad,
                    "all_reduce": 4 + used_map,
                }
                assert stats["all_reduce"]["calls"] == 2  # the gradient norm, the used map
            else:
                # the used map carries 16 more bytes: the hash of the gather order
                assert got == {
                    "all_gather": 8 * psi_pad,
                    "reduce_scatter": 4 * psi_pad,
                    "all_reduce": 4 + used_map + 16,
                }


def _frozen_blocks_task(freeze: bool) -> tuple[list[str], int, dict]:
    """ZeRO-3 GPT, its blocks frozen or not (the tied embedding and the final norm train):
    the frozen buffers still gathered when backward ends (before everything is released), how
    many there are, and one step's all_gathers."""
    from shardwise.zero.flat_param import ParamState
    from shardwise.zero.param_schedule import ParamSchedule

    torch.set_num_threads(1)
    model = zc.make_gpt()
    for p in model.blocks.parameters():
        p.requires_grad_(not freeze)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = shardwise.initialize(model, opt, shardwise.Config(zero_stage=3))
    frozen = [f for f in engine.flats if not f.trainable]
    at_end: list[list[str]] = []
    finish = ParamSchedule.finish_backward

    def spy(self: ParamSchedule, flats: list) -> None:
        at_end.append([f.names[0] for f in frozen if f.state is ParamState.FULL])
        finish(self, flats)

    ParamSchedule.finish_backward = spy  # type: ignore[method-assign]
    try:
        for x, y in zc.batches("gpt", 1, 2)[0]:
            shardwise.comm_stats(reset=True)
            engine.backward(engine(x, y))
            engine.step()
            gathers = shardwise.comm_stats()["all_gather"]
    finally:
        ParamSchedule.finish_backward = finish  # type: ignore[method-assign]
    return at_end[-1], len(frozen), gathers


def test_stage3_frees_frozen_units_that_backward_has_left():
    """A frozen unit's buffer gets no gradient, so no reduction frees it: the schedule frees
    it when backward moves on to another unit, so a frozen base (LoRA) is never whole on a
    rank. When backward ends no frozen block is still gathered, and freezing adds no gather:
    the step's all_gathers are those of the same model with every block trainable."""
    still_full, nfrozen, gathers = run_on_ranks(2, _frozen_blocks_task, True)[0]
    _, none, trainable_gathers = run_on_ranks(2, _frozen_blocks_task, False)[0]
    assert nfrozen == zc.GPT_CFG.n_layer and none == 0
    assert still_full == []
    assert (gathers["calls"], gathers["bytes"]) == (
        trainable_gathers["calls"],
        trainable_gathers["bytes"],
    )

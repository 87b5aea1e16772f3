"""Context parallelism on the built-in GPT through ``parallelize``: losses and weights after 5
AdamW steps equal one process's (fp32, rtol 1e-5), with padded targets, alone and with dp
(ZeRO 1 and 3), and the bytes cp sends per step equal each method's formula."""

from __future__ import annotations

import cp_cases as cc
import pytest

from shardwise.costmodel.context import cp_bytes_per_layer
from shardwise.costmodel.plan import Plan
from shardwise.costmodel.shapes import ModelShape
from shardwise.testing import run_on_ranks

B, D, N_LAYER, HEADS = 2, 16, 2, 4


def _ring_bytes(cp: int, world: int) -> int:
    # per layer: forward (cp - 1) blocks of K and V, backward K, V and their gradients again
    kv_local = 2 * B * (4 * world // cp) * D * cc.F32
    return N_LAYER * 3 * (cp - 1) * kv_local


def _all_to_all_bytes(cp: int, world: int) -> int:
    # per layer: Q, K, V and the output forward, their gradients backward (this rank's piece)
    act_local = B * (4 * world // cp) * D * cc.F32
    return N_LAYER * 8 * act_local


def _cost_model_bytes(
    cp: int, world: int, method: str, tp: int = 1, recompute: str = "none"
) -> float:
    """What the cost model prices a step's cp messages at for these runs (one micro-batch of
    B sequences per dp rank, fp32)."""
    shape = ModelShape("cp", N_LAYER, D, HEADS, cc.gpt_config(4).vocab_size, 4 * world)
    plan = Plan(dp=world // (cp * tp), cp=cp, tp=tp, cp_method=method, micro_batch=B,
                precision="fp32", recompute=recompute)  # fmt: skip
    return N_LAYER * cp_bytes_per_layer(shape, plan)


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
def test_gpt_cp_matches_one_process(cp, method):
    out = run_on_ranks(cp, cc.gpt_cp_parity, 1, cp, 0, method, timeout_s=600)
    want = _ring_bytes(cp, cp) if method == "ring" else _all_to_all_bytes(cp, cp)
    op = "send" if method == "ring" else "all_to_all"
    assert all(r["sent"] == {op: want} for r in out)
    assert want == _cost_model_bytes(cp, cp, method)  # the cost model's formula, exactly


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize("stage", [1, 3])
def test_gpt_dp2_cp2_zero_matches_one_process(stage, method):
    out = run_on_ranks(4, cc.gpt_cp_parity, 2, 2, stage, method, timeout_s=600)
    want = _ring_bytes(2, 4) if method == "ring" else _all_to_all_bytes(2, 4)
    op = "send" if method == "ring" else "all_to_all"
    assert all(r["sent"].get(op) == want for r in out)
    assert want == _cost_model_bytes(2, 4, method)


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_gpt_cp2_tp2_matches_one_process(method):
    # heads split over tp first (4 -> 2 per rank), then the sequence over cp
    out = run_on_ranks(4, cc.gpt_cp_parity, 1, 2, 0, method, 2, timeout_s=600)
    half = _ring_bytes(2, 4) // 2 if method == "ring" else _all_to_all_bytes(2, 4) // 2
    op = "send" if method == "ring" else "all_to_all"
    assert all(r["sent"].get(op) == half for r in out)  # this rank's heads only
    assert half == _cost_model_bytes(2, 4, method, tp=2)


def test_gpt_cp2_with_activation_checkpointing_matches_one_process():
    out = run_on_ranks(2, cc.gpt_cp_parity, 1, 2, 1, "ring", 1, True, timeout_s=600)
    # recompute reruns each block's forward: the forward's K/V blocks travel once more
    fwd = _ring_bytes(2, 2) // 3
    assert all(r["sent"] == {"send": _ring_bytes(2, 2) + fwd} for r in out)
    assert _ring_bytes(2, 2) + fwd == _cost_model_bytes(2, 2, "ring", recompute="full")


@pytest.mark.parametrize(("method", "stage"), [("ring", 1), ("all_to_all", 3)])
def test_gpt_pp2_cp2_matches_one_process(method, stage):
    out = run_on_ranks(4, cc.gpt_pp_cp_parity, method, stage, timeout_s=600)
    compared = {n for r in out for n in r["compared"]}
    assert compared >= set(out[0]["params"])  # the stages together hold every weight


def test_gpt_pp2_context_plan_pattern_matching_no_stage_is_refused():
    out = run_on_ranks(4, cc.unmatched_context_pattern_over_pp, timeout_s=300)
    assert all("layers.*.attn.nothing" in msg and "matches no module" in msg for msg in out)

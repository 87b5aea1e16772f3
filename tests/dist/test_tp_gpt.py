"""Tensor and sequence parallelism on the built-in GPT match one process (fp32)."""

from __future__ import annotations

import pytest
import torch
import tp_cases as tc

from shardwise.testing import run_on_ranks

B, S, H = tc.BATCH, tc.SEQ, 16
F32 = 4


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size,vocab", [(2, 37), (2, 40), (4, 37)])
def test_gpt_parity_adamw(tp_size, vocab, sp):
    # losses, step-0 gradients, logits and all weights after 5 AdamW steps vs one process;
    # vocab 37 does not divide by tp (padded), ignore_index targets in every batch
    losses = run_on_ranks(tp_size, tc.gpt_parity, tp_size, sp, vocab, timeout_s=600)
    assert all(row == losses[0] for row in losses)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_recompute_gives_bitwise_equal_grads_with_dropout(sp):
    run_on_ranks(2, tc.recompute_bitwise, 2, sp, timeout_s=600)


def test_dropout_differs_across_tp_only_in_sharded_regions():
    plain = run_on_ranks(2, tc.dropout_masks, 2, False)
    assert torch.equal(plain[0]["mask"], plain[1]["mask"]), "replicated region: masks must match"
    sharded = run_on_ranks(2, tc.dropout_masks, 2, True)
    assert sharded[0]["mask"].shape == (B, S // 2, H)
    assert not torch.equal(sharded[0]["mask"], sharded[1]["mask"]), "sequence shards: must differ"
    for r in (plain, sharded):  # tp.sharded_rng(): per-rank draws; the replicated stream goes on
        assert not torch.equal(r[0]["sharded"], r[1]["sharded"])
        assert torch.equal(r[0]["replicated"], r[1]["replicated"])


def test_replicated_params_bitwise_equal_after_20_steps_with_sp():
    results = run_on_ranks(4, tc.replicas_after_steps, 4, 20, timeout_s=600)
    assert results[0], "the GPT has tp-replicated parameters"
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for k, v in results[0].items():
            assert torch.equal(other[k], v), f"{k} differs across tp ranks"


def _bytes(stats, op):
    return stats.get(op, {}).get("bytes", 0), stats.get(op, {}).get("calls", 0)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_comm_bytes_per_block_per_microbatch(tp_size):
    # per block: forward 2 all_reduce of b*s*h, backward 2; the embedding adds one all_reduce
    # forward, the head's input one backward, the vocab-parallel loss 3 all_reduce of b*s
    # forward and nothing backward
    act, tok = B * S * H * F32, B * S * F32
    for n_layer in (1, 2):
        got = run_on_ranks(tp_size, tc.comm_counts, tp_size, False, n_layer)[0]
        assert set(got["fwd"]) == {"all_reduce"} and set(got["bwd"]) == {"all_reduce"}
        assert _bytes(got["fwd"], "all_reduce") == (
            (2 * n_layer + 1) * act + 3 * tok,
            2 * n_layer + 1 + 3,
        )
        assert _bytes(got["bwd"], "all_reduce") == ((2 * n_layer + 1) * act, 2 * n_layer + 1)
        assert got["partial"] == []  # without SP no replicated gradient is partial


@pytest.mark.parametrize("tp_size", [2, 4])
def test_comm_bytes_with_sequence_parallelism(tp_size):
    # each all_reduce becomes an all_gather plus a reduce_scatter of the same b*s*h bytes
    act, tok = B * S * H * F32, B * S * F32
    for n_layer in (1, 2):
        got = run_on_ranks(tp_size, tc.comm_counts, tp_size, True, n_layer)[0]
        n = 2 * n_layer + 1  # per block 2, plus the embedding (or the head's input)
        assert _bytes(got["fwd"], "reduce_scatter") == (n * act, n)
        assert _bytes(got["fwd"], "all_gather") == (n * act, n)
        assert _bytes(got["fwd"], "all_reduce") == (3 * tok, 3)  # the loss only
        assert _bytes(got["bwd"], "reduce_scatter") == (n * act, n)
        # each all_gather of forward again in backward: the column layers keep only their
        # input's sequence shard and regather it for the weight gradient (once for q, k, v)
        assert _bytes(got["bwd"], "all_gather") == (2 * n * act, 2 * n)
        # plus, in backward, one all_reduce per replicated parameter used on 1/tp of the
        # sequence: the position embedding, per block two norms (weight, bias) and the two
        # row-parallel biases, and the final norm
        partial = [S * H] + [H] * 6 * n_layer + [H, H]
        assert sorted(got["partial"]) == sorted(partial)
        assert _bytes(got["bwd"], "all_reduce") == (F32 * sum(partial), len(partial))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_sequence_parallel_block_keeps_1_over_tp_of_the_activations(tp_size):
    # under SP the column layers keep their input's sequence shard and regather it in backward
    plain = run_on_ranks(1, tc.block_activation_bytes, 1, False)[0]
    sp = run_on_ranks(tp_size, tc.block_activation_bytes, tp_size, True)
    tp_only = run_on_ranks(tp_size, tc.block_activation_bytes, tp_size, False)
    for got in sp:
        assert got <= plain / tp_size * 1.05, (got, plain)
    assert all(t > s for t, s in zip(tp_only, sp))  # tp alone keeps full-width norms' inputs


def test_pipeline_stage_is_tensor_parallel_without_special_cases():
    losses = run_on_ranks(4, tc.pipeline_stage_tp, timeout_s=600)
    assert all(v == losses[0] for v in losses)

"""Exact attention over the cp axis (ring and all-to-all) against full attention on one
device: outputs and gradients, causal or not, with a padding mask, and the bytes each sends."""

from __future__ import annotations

import cp_cases as cc
import pytest

from shardwise.testing import run_on_ranks

B, H, D = 2, 4, 8


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(cp, causal, padded):
    kv_heads = 2  # grouped-query: 2 query heads per key/value head
    stats = run_on_ranks(cp, cc.attention_vs_full, "ring", causal, padded, kv_heads)
    kv_local = 2 * B * kv_heads * (8 * cp // cp) * D * cc.F32  # K and V of one rank
    # forward: (cp - 1) blocks of K and V; backward: K and V again and their gradients
    for s in stats:
        assert s["send"] == 3 * (cp - 1) * kv_local
        assert s["recv"] == 3 * (cp - 1) * kv_local
        assert set(s) == {"send", "recv"}


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("cp", [2, 4])
def test_all_to_all_attention_matches_full_attention(cp, causal, padded):
    kv_heads = cp  # key/value heads must divide by cp
    stats = run_on_ranks(cp, cc.attention_vs_full, "all_to_all", causal, padded, kv_heads)
    seq_local = 8
    q = B * H * seq_local * D * cc.F32
    kv = B * kv_heads * seq_local * D * cc.F32
    # four all-to-alls forward (q, k, v, out) and their four gradients backward
    for s in stats:
        assert s == {"all_to_all": 2 * (2 * q + 2 * kv)}


def test_all_to_all_refuses_heads_not_divisible_by_cp():
    with pytest.raises(Exception, match="2 key/value heads; both must divide by cp"):
        run_on_ranks(4, cc.attention_vs_full, "all_to_all", True, False, 2)

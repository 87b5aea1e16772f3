"""Pipelines on sub-worlds: meshes over some ranks of a 4-rank world, their pp ranks in another
order than the world's, each training its own pipeline against one process."""

from __future__ import annotations

import pipeline_cases as pc
import pytest
import torch
from test_pipeline_executor import N_BLOCKS, _p2p_bytes, _reference

from shardwise.testing import run_on_ranks


def test_two_pipelines_on_halves_of_the_world_match_one_process() -> None:
    """1F1B on world ranks (3, 1), GPipe on (0, 2), at the same time: each rank's loss and
    gradients equal the whole batch's in one process, the tied copies are bitwise equal, and
    each rank sends and receives exactly its pipeline's bytes. A pp=3 mesh over 3 of the 4
    ranks, built by those 3 alone, whose tied embedding lives on its first and last stage,
    trains to the same loss and gradients (its tied group formed by its 2 holders alone)."""
    want_loss, want = _reference()
    out = run_on_ranks(4, pc.task_on_subworlds, N_BLOCKS, timeout_s=300)
    assert [r["pp"] for r in out] == [0, 1, 1, 0]
    for pair in ((3, 1), (0, 2)):
        tied = [out[r]["grads"]["tied.embed.weight"] for r in pair]
        assert torch.equal(tied[0], tied[1])
        for r in pair:
            res = out[r]
            assert res["loss"] == pytest.approx(want_loss, rel=1e-6)
            for k, g in res["grads"].items():
                torch.testing.assert_close(g, want[k], rtol=1e-5, atol=1e-6, msg=f"rank {r} {k}")
            sent, received = _p2p_bytes(2, 1, res["pp"])
            assert (res["stats"]["send"]["bytes"], res["stats"]["recv"]["bytes"]) == (
                sent,
                received,
            )
        assert set(out[pair[0]]["grads"]) | set(out[pair[1]]["grads"]) == set(want)
    three = [out[r]["three"] for r in (0, 1, 2)]
    assert "three" not in out[3]
    tied = [three[r]["grads"]["tied.embed.weight"] for r in (0, 2)]
    assert torch.equal(tied[0], tied[1])
    for r, res in enumerate(three):
        assert res["loss"] == pytest.approx(want_loss, rel=1e-6)
        for k, g in res["grads"].items():
            torch.testing.assert_close(g, want[k], rtol=1e-5, atol=1e-6, msg=f"pp3 rank {r} {k}")
    assert set().union(*(res["grads"] for res in three)) == set(want)

"""An engine on a sub-world (a 2-rank group of a 4-rank world, or a 2 x 1 mesh over it) trains,
saves and loads its own checkpoint, recording its group's size, while the other ranks work
apart."""

from __future__ import annotations

import pytest
import subworld_cases as sc

from shardwise.testing import run_on_ranks


@pytest.mark.parametrize(("stage", "use_mesh"), [(2, False), (3, True)])
def test_an_engine_on_half_the_world_saves_and_loads_its_own_checkpoint(
    tmp_path, stage: int, use_mesh: bool
) -> None:
    out = run_on_ranks(4, sc.train_save_load_on_half, str(tmp_path / "ck"), stage, use_mesh)
    a, b = out[0], out[1]
    assert a["first"] == b["first"] and len(a["first"]) == 2
    assert a["again"] == a["third"]  # the loaded engine takes the same third step, bit for bit
    assert a["recorded"] == (2, 2)  # the saving group's size, not the world's 4
    assert a["step"] == 3
    assert out[2]["other"] == out[3]["other"] == [5.0 * 2**2] * 3  # (2 + 3) doubled twice more

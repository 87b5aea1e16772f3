"""Hugging Face round trips (#19): a directory ``transformers`` wrote, streamed into a model
built on the meta device at each layout, equals the source tensors; three AdamW steps equal
``transformers`` training in one process; the export loads back with the engine's logits."""

from __future__ import annotations

import pytest
import roundtrip_cases as rc

from shardwise.testing import run_on_ranks

pytest.importorskip("transformers")

WORLD = {"one": 1, "dp2_zero3": 2, "dp2_tp2": 4, "pp2": 2}
CASES = [
    ("llama", "one"),
    ("llama", "dp2_zero3"),
    ("llama", "dp2_tp2"),
    ("llama", "pp2"),
    ("gpt2", "one"),
    ("gpt2", "dp2_zero3"),
    ("gpt2", "dp2_tp2"),
    ("gpt2", "pp2"),
]


@pytest.fixture(scope="module")
def source_dirs(tmp_path_factory):
    out = {}
    for kind in ("llama", "gpt2"):
        path = tmp_path_factory.mktemp(kind)
        rc.write_source(kind, str(path))
        assert (path / "model.safetensors.index.json").is_file()  # sharded
        out[kind] = str(path)
    return out


@pytest.mark.parametrize("kind,layout", CASES)
def test_round_trip(source_dirs, tmp_path, kind, layout):
    world = WORLD[layout]
    rows = run_on_ranks(
        world, rc.round_trip, kind, layout, source_dirs[kind], str(tmp_path), timeout_s=300
    )
    want = rows[0]["want"]
    for step in range(rc.STEPS):
        # each rank's loss is its dp rank's batch share's; their mean is the whole batch's
        mean = sum(r["losses"][step] for r in rows) / world
        assert mean == pytest.approx(want[step], rel=1e-5)
    assert all(r["loaded"] > 0 for r in rows)
    assert any(r["logits"] for r in rows)


@pytest.mark.parametrize("layout", ["one", "dp2_tp2"])
def test_gpt2_checkpoint_saved_at_dp2_tp2_loads_at(source_dirs, tmp_path, layout):
    """Its fused c_attn pieces (each rank's heads of q, k and v) are saved where they belong
    in the whole tensor and read back at another layout and at the same one."""
    root = str(tmp_path / "ckpt")
    run_on_ranks(4, rc.save_trained, "gpt2", "dp2_tp2", source_dirs["gpt2"], root, timeout_s=300)
    rows = run_on_ranks(
        WORLD[layout], rc.load_and_finish, "gpt2", layout, source_dirs["gpt2"], root, timeout_s=300
    )
    want = rc.reference("gpt2", 2)[0][rc.STEPS - 1]
    mean = sum(r["loss"] for r in rows) / len(rows)  # each rank's loss is its dp share's
    assert mean == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_lora_adapter_from_a_streamed_base(source_dirs, tmp_path, stage):
    pytest.importorskip("peft")
    rows = run_on_ranks(
        2, rc.lora_round_trip, source_dirs["llama"], str(tmp_path), stage, timeout_s=300
    )
    # 2 layers x (q, v) x (A, B), and nothing of the base
    assert len(rows[0]["adapter"]) == 8
    assert all(".lora_A." in n or ".lora_B." in n for n in rows[0]["adapter"])
    assert rows[0]["files"] == ["adapter_config.json", "adapter_model.safetensors"]

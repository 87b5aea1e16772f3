"""Config parsing and validation; shard math; the stage policy."""

from __future__ import annotations

import pytest

from shardwise import Config
from shardwise.zero.partition import layout, padded_numel, pieces_in, shard_range
from shardwise.zero.stage import ZeroStage


def test_config_files_and_dump(tmp_path):
    (tmp_path / "c.toml").write_text(
        "zero_stage = 2\nmicro_batch_size = 4\ngradient_accumulation_steps = 3\n"
    )
    (tmp_path / "c.yaml").write_text("zero_stage: 3\nprecision: bf16\n")
    (tmp_path / "c.json").write_text('{"zero_stage": 1, "gradient_clipping": 1.0}')
    assert Config.from_file(tmp_path / "c.toml").zero_stage == 2
    assert Config.from_file(tmp_path / "c.yaml").precision == "bf16"
    assert Config.from_file(tmp_path / "c.json").gradient_clipping == 1.0
    dump = Config.from_file(tmp_path / "c.toml").dump(dp_size=2)
    assert "global_batch_size = 4 x 3 x 2 = 24" in dump and "zero_stage = 2" in dump


@pytest.mark.parametrize(
    "values, message",
    [
        ({"zero_stage": 4}, r"zero_stage must be one of \[0, 1, 2, 3\], got 4"),
        ({"precision": "fp8"}, r"precision must be one of \['fp32', 'bf16', 'fp16'\]"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an int >= 1"),
        ({"gradient_clipping": -1.0}, "gradient_clipping must be a number > 0"),
        ({"gradent_clipping": 1.0}, "did you mean 'gradient_clipping'"),
        ({"resume": "auto"}, "needs checkpoint_dir"),
        ({"wrap_policy": "Block"}, "must be a list of module class names"),
        ({"pipeline_schedule": "1F1B"}, r"pipeline_schedule must be one of \['gpipe', '1f1b'"),
        ({"pipeline_microbatches": 0}, "pipeline_microbatches must be an int >= 1"),
        ({"pipeline_virtual_stages": 0}, r"pipeline_virtual_stages must be an int in 1\.\.1024"),
    ],
)
def test_config_errors_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        Config.from_dict(values)


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Config.from_file(tmp_path / "missing.toml")
    (tmp_path / "c.ini").write_text("x")
    with pytest.raises(ValueError, match=r"must end in \.json, \.toml"):
        Config.from_file(tmp_path / "c.ini")


def test_partition_math():
    assert padded_numel(10, 3) == 12 and padded_numel(12, 3) == 12 and padded_numel(0, 4) == 4
    slots, total = layout(["a", "b"], [(2, 3), (5,)])
    assert total == 11 and slots[1].offset == 6
    padded = padded_numel(total, 3)
    ranges = [shard_range(padded, 3, r) for r in range(3)]
    assert ranges == [(0, 4), (4, 8), (8, 12)]
    owned = [
        [(p.slot.name, p.param_start, p.param_stop, p.shard_start) for p in pieces_in(slots, *rg)]
        for rg in ranges
    ]
    assert owned == [[("a", 0, 4, 0)], [("a", 4, 6, 0), ("b", 0, 2, 2)], [("b", 2, 5, 0)]]


def test_stage_policy():
    assert ZeroStage.of(0) == ZeroStage(0, False, False, False)
    s2 = ZeroStage.of(2)
    assert s2.shard_optimizer and s2.shard_grads and not s2.shard_params
    assert s2.reduce_every_micro_step and s2.gather_after_step
    assert not ZeroStage.of(3).gather_after_step
    with pytest.raises(ValueError, match="zero_stage must be one of"):
        ZeroStage.of(7)


def test_config_pipeline_schedules_are_the_library_s():
    from shardwise.config import PIPELINE_SCHEDULES
    from shardwise.parallel.pipeline import SCHEDULES

    assert PIPELINE_SCHEDULES == SCHEDULES

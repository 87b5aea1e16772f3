"""Every Config field is checked for type and range at construction, from Python and files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise import Config
from shardwise.config import ConfigTypeError
from shardwise.train.options import RunConfig, TrainOptions


@pytest.mark.parametrize(
    "values, error, message",
    [
        ({"seed": "abc"}, TypeError, r"seed must be an int, got 'abc' \(str\)"),
        ({"seed": True}, TypeError, "seed must be an int, got True"),
        ({"seed": -1}, ValueError, r"seed must be an int in 0\.\.9223372036854775807"),
        ({"checkpoint_dir": 123}, TypeError, "checkpoint_dir must be a string or None, got 123"),
        ({"initial_loss_scale_power": 10000}, ValueError, r"in 0\.\.63, got 10000"),
        ({"offload_optimizer": "false"}, TypeError, "offload_optimizer must be true or false"),
        ({"async_save": "no"}, TypeError, "async_save must be true or false"),
        ({"async_save": 1}, TypeError, "async_save must be true or false"),
        ({"gradient_clipping": float("inf")}, TypeError, "gradient_clipping must be a finite"),
        ({"min_loss_scale": 2.0**20}, ValueError, r"at most the initial loss scale 2\*\*16"),
        (
            {"micro_batch_size": 10**12},
            ValueError,
            r"micro_batch_size must be an int <= 2147483647",
        ),
        ({"reduce_bucket_bytes": 1.5}, TypeError, "reduce_bucket_bytes must be an int"),
        ({"activation_checkpointing": ["Block", 3]}, TypeError, "a list of module class names"),
        ({"extra": [1]}, TypeError, "extra must be a mapping with string keys"),
        ({"keep_last": 0}, ValueError, "keep_last must be an int >= 1"),
    ],
)
def test_bad_values_are_refused_at_construction(values, error, message):
    with pytest.raises(error, match=message):
        Config(**values)
    with pytest.raises(ValueError, match=message):  # ConfigTypeError is a ValueError too
        Config.from_dict(values)


def test_paths_and_good_values_pass():
    cfg = Config(checkpoint_dir=Path("/tmp/ckpt"), gradient_clipping=1, min_loss_scale=1)
    assert cfg.checkpoint_dir == "/tmp/ckpt" and isinstance(cfg.checkpoint_dir, str)
    assert Config(offload_optimizer=False, async_save=True, seed=2**40).async_save is True


def test_json_strings_are_never_truthy(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"offload_optimizer": "false", "async_save": "no"}))
    with pytest.raises(ConfigTypeError, match=f"config file {path}: offload_optimizer must be"):
        Config.from_file(path)
    path.write_text(json.dumps({"offload_optimizer": False, "async_save": True}))
    cfg = Config.from_file(path)
    assert cfg.offload_optimizer is False and cfg.async_save is True


@pytest.mark.parametrize(
    "name, text",
    [
        ("c.yaml", "zero_stage: [1\nprecision: bf16\n"),
        ("c.json", '{"zero_stage": 1,'),
        ("c.toml", "zero_stage = \n"),
    ],
)
def test_syntax_errors_are_one_line_naming_the_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        Config.from_file(path)
    message = str(info.value)
    assert message.startswith(f"config file {path} is not valid ") and "\n" not in message


def test_a_damaged_run_config_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path} is not valid JSON"):
        RunConfig.read(path)
    run = RunConfig(
        train=TrainOptions(model="tiny"), engine=Config(micro_batch_size=2), world_size=1
    )
    data = run.to_dict()
    data["shardwise"]["seed"] = "abc"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{path}: .*seed must be an int"):
        RunConfig.read(path)

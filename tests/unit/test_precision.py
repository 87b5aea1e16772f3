"""Precision policy resolution and dynamic loss scaling."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from shardwise.precision import (
    DynamicLossScaler,
    PrecisionPolicy,
    resolve_precision,
)

torch.set_num_threads(1)

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# resolve_precision
# ---------------------------------------------------------------------------------------------


def test_fp32_policy() -> None:
    assert resolve_precision("fp32", None, CPU) == PrecisionPolicy(
        compute_dtype=torch.float32,
        reduce_dtype=torch.float32,
        master_dtype=torch.float32,
        needs_loss_scaling=False,
    )


def test_bf16_reduces_in_fp32_by_default() -> None:
    policy = resolve_precision("bf16", None, CPU)
    assert policy.compute_dtype == torch.bfloat16
    assert policy.reduce_dtype == torch.float32
    assert policy.master_dtype == torch.float32
    assert not policy.needs_loss_scaling


def test_fp16_needs_loss_scaling_and_reduces_in_fp32() -> None:
    policy = resolve_precision("fp16", None, CPU)  # torch's CPU kernels run fp16 matmul
    assert policy.compute_dtype == torch.float16
    assert policy.reduce_dtype == torch.float32
    assert policy.master_dtype == torch.float32
    assert policy.needs_loss_scaling


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_reduce_on_request(name: str, dtype: torch.dtype) -> None:
    assert resolve_precision("bf16", name, CPU).reduce_dtype == dtype


@pytest.mark.parametrize(
    ("precision", "reduce_dtype", "field"),
    [("fp8", None, "precision"), ("float16", None, "precision"), ("bf16", "int8", "reduce_dtype")],
)
def test_unknown_names_list_the_options(
    precision: str, reduce_dtype: str | None, field: str
) -> None:
    with pytest.raises(ValueError, match=rf"{field}=.*'fp32', 'bf16', 'fp16'"):
        resolve_precision(precision, reduce_dtype, CPU)


def test_dtype_the_device_cannot_run_is_rejected() -> None:
    # The meta device computes no values, so the probe cannot confirm that fp16 works there.
    with pytest.raises(ValueError, match=r"precision='fp16' cannot run on meta"):
        resolve_precision("fp16", None, torch.device("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_precision_without_cuda_is_rejected(precision: str) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_precision(precision, None, torch.device("cuda"))
    assert resolve_precision("fp32", None, torch.device("cuda")).compute_dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# DynamicLossScaler
# ---------------------------------------------------------------------------------------------


def test_overflow_halves_the_scale_and_skips_the_step() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0)
    assert scaler.update(found_inf=True) is True
    assert scaler.scale == 512.0
    assert scaler.update(found_inf=True) is True
    assert scaler.scale == 256.0


def test_scale_doubles_after_growth_interval_clean_steps() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    assert [scaler.update(found_inf=False) for _ in range(2)] == [False, False]
    assert scaler.scale == 8.0
    scaler.update(found_inf=False)
    assert scaler.scale == 16.0
    # An overflow restarts the count of clean steps.
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 8.0
    scaler.update(found_inf=False)
    assert scaler.scale == 16.0


def test_scale_never_goes_below_min_scale(caplog: pytest.LogCaptureFixture) -> None:
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.5)
    with caplog.at_level(logging.WARNING, logger="shardwise.precision"):
        scaler.update(found_inf=True)
        assert scaler.scale == 2.0
        scaler.update(found_inf=True)
        assert scaler.scale == 1.5
        assert not caplog.records  # reaching the floor is not yet stuck
        assert scaler.update(found_inf=True) is True
        assert scaler.scale == 1.5
    assert len(caplog.records) == 1
    assert "min_scale" in caplog.text  # the engine's own skip warning names the rank


def test_scale_loss() -> None:
    scaler = DynamicLossScaler(init_scale=256.0)
    loss = torch.tensor(0.5, dtype=torch.float16)
    scaled = scaler.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 128.0


def test_disabled_scaler_is_a_no_op() -> None:
    scaler = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale == 1.0
    assert scaler.scale_loss(loss) is loss
    assert scaler.update(found_inf=True) is False
    assert scaler.scale == 1.0


def test_state_dict_round_trip() -> None:
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=4)
    for found_inf in (True, False, False, False):
        scaler.update(found_inf)
    state = scaler.state_dict()
    assert state == {"scale": 32.0, "clean_steps": 3}

    restored = DynamicLossScaler(init_scale=2.0**16, growth_interval=4)
    restored.load_state_dict(state)
    assert restored.scale == 32.0
    restored.update(found_inf=False)  # the fourth clean step in a row grows the scale
    assert restored.scale == 64.0
    with pytest.raises(ValueError, match="clean_steps"):
        restored.load_state_dict({"scale": 2.0})
    with pytest.raises(ValueError, match="finite scale"):
        restored.load_state_dict({"scale": float("inf"), "clean_steps": 0})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"init_scale": 1.0, "min_scale": 2.0}, "min_scale"),
    ],
)
def test_scaler_rejects_bad_arguments(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)

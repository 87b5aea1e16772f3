"""Dtypes and loss scaling: which dtype computes, which reduces gradients, which holds masters.

`resolve_precision` turns the user's ``precision`` / ``reduce_dtype`` names into a
`PrecisionPolicy` and checks that the device can run the compute dtype. `DynamicLossScaler`
keeps fp16 gradients inside fp16's range (Micikevicius et al., "Mixed Precision Training",
ICLR 2018, section 3.2: scale the loss, skip the step and lower the scale on overflow, raise it
again after a run of clean steps).

Nothing here communicates: the caller agrees on overflow across ranks (``zero.step`` reduces the
squared gradient norm, which is not finite after an overflow) before ``update``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

__all__ = [
    "PRECISIONS",
    "DynamicLossScaler",
    "Precision",
    "PrecisionPolicy",
    "resolve_precision",
]

log = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
"""The precision names every part of shardwise accepts (config, CLI, estimator)."""
_DTYPES: dict[str, torch.dtype] = dict(
    zip(PRECISIONS, (torch.float32, torch.bfloat16, torch.float16), strict=True)
)


# ---------------------------------------------------------------------------------------------
# Precision policy
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Resolved dtypes of one training run."""

    compute_dtype: torch.dtype
    """Dtype of parameters and activations in forward and backward."""
    reduce_dtype: torch.dtype
    """Dtype gradients are summed in across ranks."""
    master_dtype: torch.dtype
    """Dtype of the optimizer's master copy of the parameters."""
    needs_loss_scaling: bool
    """Whether gradients need a `DynamicLossScaler` to stay inside the compute dtype's range."""


def _dtype_of(field_name: str, name: str) -> torch.dtype:
    if name not in _DTYPES:
        options = ", ".join(repr(p) for p in PRECISIONS)
        raise ValueError(f"{field_name}={name!r} is not supported; choose one of {options}")
    return _DTYPES[name]


@functools.cache
def _runs_matmul_backward(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether a tiny matmul and its backward run in ``dtype`` on the device (cached)."""
    device = torch.device(device_type if device_index is None else f"{device_type}:{device_index}")
    try:
        with torch.enable_grad():
            a = torch.ones(2, 2, dtype=dtype, device=device, requires_grad=True)
            b = torch.ones(2, 2, dtype=dtype, device=device)
            (a @ b).sum().backward()
            return a.grad is not None and bool(torch.isfinite(a.grad).all())
    except (RuntimeError, NotImplementedError, TypeError, AssertionError):
        return False


def _check_runs(name: str, device: torch.device) -> None:
    """Raise ValueError when ``device`` cannot compute in the low-precision dtype ``name``."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"precision={name!r} was requested on {device}, but CUDA is not available; "
                "use a CPU device or run where CUDA is available"
            )
        if name == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"precision='bf16' is not supported by {device}; use precision='fp16' "
                "(with loss scaling) or precision='fp32'"
            )
    if not _runs_matmul_backward(device.type, device.index, _DTYPES[name]):
        raise ValueError(
            f"precision={name!r} cannot run on {device} (a {name} matmul with backward failed); "
            "use precision='fp32' or another device"
        )


def resolve_precision(
    precision: str, reduce_dtype: str | None, device: torch.device | str
) -> PrecisionPolicy:
    """Resolve precision names into dtypes, checking that ``device`` can compute in them.

    Args:
        precision: compute dtype name, one of ``"fp32"``, ``"bf16"``, ``"fp16"``.
        reduce_dtype: dtype name for summing gradients across ranks; ``None`` means fp32, so
            small per-rank gradients are not lost in a low-precision sum.
        device: the device this rank computes on.

    Returns:
        The policy; fp32 master weights always, loss scaling only for fp16.

    Raises:
        ValueError: an unknown name, or a compute dtype the device cannot run (fp16 or bf16
            that fails a tiny matmul + backward, bf16 on a CUDA device without bf16 support).
    """
    compute = _dtype_of("precision", precision)
    reduce = torch.float32 if reduce_dtype is None else _dtype_of("reduce_dtype", reduce_dtype)
    device = torch.device(device)
    if precision != "fp32":
        _check_runs(precision, device)
    return PrecisionPolicy(
        compute_dtype=compute,
        reduce_dtype=reduce,
        master_dtype=torch.float32,
        needs_loss_scaling=precision == "fp16",
    )


# ---------------------------------------------------------------------------------------------
# Loss scaling
# ---------------------------------------------------------------------------------------------


def _check_scaler_args(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float,
) -> None:
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale must be a finite number > 0; got {init_scale}")
    if not (math.isfinite(growth_factor) and growth_factor > 1):
        raise ValueError(f"growth_factor must be > 1 (e.g. 2.0); got {growth_factor}")
    if not 0 < backoff_factor < 1:
        raise ValueError(f"backoff_factor must be in (0, 1) (e.g. 0.5); got {backoff_factor}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
        raise ValueError(f"growth_interval must be an int >= 1 (steps); got {growth_interval!r}")
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be >= 1 (steps); got {growth_interval}")
    if not (math.isfinite(min_scale) and 0 < min_scale <= init_scale):
        raise ValueError(f"min_scale must be > 0 and <= init_scale ({init_scale}); got {min_scale}")


class DynamicLossScaler:
    """Loss scale for fp16 training that backs off on overflow and grows after clean steps.

    Per step: ``scale_loss(loss).backward()``; agree across ranks whether any gradient overflowed
    (``zero.step`` reduces the squared norm); divide the gradients by ``scale``; if
    ``update(found_inf)`` returns True, skip the optimizer step. On overflow the scale is
    multiplied by ``backoff_factor`` (not below ``min_scale``); after ``growth_interval``
    consecutive clean steps it is multiplied by ``growth_factor``. When disabled the scale is 1.0
    and every method is a no-op.

    Args:
        init_scale: starting scale.
        growth_factor: multiplier after ``growth_interval`` clean steps, > 1.
        backoff_factor: multiplier on overflow, in (0, 1).
        growth_interval: clean steps (optimizer steps taken) before growing, >= 1.
        min_scale: floor of the scale, > 0.
        enabled: False turns scaling off (fp32 / bf16).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        enabled: bool = True,
    ) -> None:
        _check_scaler_args(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.enabled = enabled
        self._scale = float(init_scale)
        self._clean_steps = 0  # consecutive steps without overflow since the last change
        self._skips_at_floor = 0  # consecutive overflows while already at min_scale

    @property
    def scale(self) -> float:
        """Current loss scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``; fp16 / bf16 losses are scaled in fp32 so the product stays finite."""
        if not self.enabled:
            return loss
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * self._scale

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after a step; returns True when the step must be skipped.

        ``found_inf`` must already be agreed on by all ranks (MAX-reduced), so every rank
        skips the same steps and keeps the same scale.
        """
        if not self.enabled:
            return False
        if not found_inf:
            self._skips_at_floor = 0
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                grown = self._scale * self.growth_factor
                if math.isfinite(grown):
                    self._scale = grown
                self._clean_steps = 0
            return False
        self._clean_steps = 0
        if self._scale <= self.min_scale:
            self._skips_at_floor += 1
            # no rank here: the scaler knows no group; the engine's skip warning names it
            log.warning(
                "gradients overflowed with the loss scale at min_scale=%g (%d steps in a "
                "row skipped); the loss or gradients are non-finite regardless of scaling",
                self.min_scale,
                self._skips_at_floor,
            )
        self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        return True

    def state_dict(self) -> dict[str, Any]:
        """The evolving state: current scale and the count of clean steps since it last changed."""
        return {"scale": self._scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output; the factors and interval come from the constructor."""
        missing = [key for key in ("scale", "clean_steps") if key not in state]
        if missing:
            raise ValueError(f"loss scaler state is missing {missing}; pass state_dict() output")
        scale, clean_steps = float(state["scale"]), int(state["clean_steps"])
        if not (math.isfinite(scale) and scale > 0) or clean_steps < 0:
            raise ValueError(
                f"loss scaler state has scale={scale}, clean_steps={clean_steps}; "
                "expected a finite scale > 0 and clean_steps >= 0"
            )
        self._scale, self._clean_steps, self._skips_at_floor = scale, clean_steps, 0

"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

The rate is a pure function of the step, so a resumed run continues the same curve without any
scheduler state in the checkpoint.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, total: int, warmup: int, min_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total``.

    Rises linearly from ``peak / warmup`` to ``peak`` over the first ``warmup`` steps, then
    follows half a cosine down to ``peak * min_ratio`` at the last step.
    """
    if total < 1 or warmup < 0 or step < 0:
        raise ValueError(
            f"lr_at needs step >= 0, total >= 1, warmup >= 0; got step={step}, "
            f"total={total}, warmup={warmup}"
        )
    if step < warmup:
        return peak * (step + 1) / warmup
    floor = peak * min_ratio
    span = max(1, total - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))

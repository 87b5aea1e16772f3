"""The figure of an ``--auto`` run in ``shardwise report``: the cost model's prediction against
the measured steps, the whole step and term by term."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from shardwise.train.plan_check import TERMS, WARMUP_STEPS


def plot_prediction(records: list[dict[str, Any]], plan: dict[str, Any], path: Path) -> Path:
    """Left: each step's measured time and the predicted step time (the warm-up shaded);
    right: the predicted and measured seconds of each term (``plan_check``)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    steps = [r["step"] for r in records]
    left.plot(steps, [r["step_time_s"] for r in records], color="#4C72B0", label="measured")
    predicted = plan["predicted"]["step_time_s"]
    left.axhline(predicted, color="#DD8452", linestyle="--", label=f"predicted {predicted:.3f} s")
    left.axvspan(0.5, WARMUP_STEPS + 0.5, color="#999999", alpha=0.15, label="warm-up")
    error = plan["measured"]["step_time_s"] / predicted - 1 if predicted else 0.0
    left.set(xlabel="optimizer step", ylabel="step time (s)", ylim=(0, None),
             title=f"Step time: measured {error:+.0%} off the prediction")  # fmt: skip
    left.legend(frameon=False, fontsize=8)
    pred_terms = plan["predicted"]["breakdown_s"]
    meas_terms = plan["measured"]["terms_s"]
    x = range(len(TERMS))
    right.bar([i - 0.2 for i in x], [pred_terms.get(t, 0.0) for t in TERMS], 0.4,
              color="#DD8452", label="predicted")  # fmt: skip
    right.bar([i + 0.2 for i in x], [meas_terms.get(t, 0.0) for t in TERMS], 0.4,
              color="#4C72B0", label="measured")  # fmt: skip
    right.set_xticks(list(x), TERMS)
    right.set(ylabel="seconds per step", title=f"By term ({plan['layout']})")
    right.title.set_fontsize(8)
    right.legend(frameon=False, fontsize=8)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

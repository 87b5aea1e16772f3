"""The figures of ``shardwise report``, drawn with matplotlib's Agg backend from step records.

Each ``plot_*`` function takes the records of ``metrics.jsonl`` (see ``metrics.py``) and writes
one PNG: loss, throughput, memory per rank, communication versus computation time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from shardwise.bytesize import byte_unit
from shardwise.train.summary import CATEGORIES, peak_memory

Records = list[dict[str, Any]]

COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer": "#55A868",
    "buffers": "#8172B3",
    "comm": "#C44E52",
}
"""One color per memory category, the same in every figure."""

DPI = 110


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _window(n: int) -> int:
    return max(1, min(50, n // 20))


def _figure(height: float = 4.2) -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=(8, height), dpi=DPI)
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    return fig, ax


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_loss(records: Records, baseline: float | None, path: Path) -> Path:
    """Training loss (raw and smoothed), validation loss and the unigram baseline."""
    fig, ax = _figure()
    steps = [r["step"] for r in records]
    loss = [r["loss"] if r.get("loss") is not None else math.nan for r in records]
    ax.plot(steps, loss, color="#4C72B0", alpha=0.25, linewidth=0.8, label="train (per step)")
    ax.plot(
        steps,
        smooth(loss, _window(len(loss))),
        color="#4C72B0",
        linewidth=1.8,
        label="train (smoothed)",
    )
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(
            *zip(*val), color="#DD8452", marker="o", markersize=4, linewidth=1.6, label="validation"
        )
        last_step, last = val[-1]
        ax.annotate(
            f"{last:.3f}",
            (last_step, last),
            textcoords="offset points",
            xytext=(-4, 8),
            ha="right",
            color="#DD8452",
            fontsize=9,
        )
    if baseline is not None:
        ax.axhline(
            baseline,
            color="#555555",
            linestyle="--",
            linewidth=1.2,
            label=f"unigram baseline ({baseline:.2f})",
        )
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats/token)", title="Loss")
    ax.legend(loc="upper right", frameon=False)
    return _save(fig, path)


def plot_throughput(records: Records, path: Path) -> Path:
    """Training tokens per second over all ranks, per step and smoothed."""
    fig, ax = _figure(3.6)
    steps = [r["step"] for r in records]
    rate = [r.get("tokens_per_s") or 0.0 for r in records]
    div, unit = (1e3, "k tokens/s") if max(rate, default=0) >= 1e3 else (1.0, "tokens/s")
    ax.plot(
        steps, [v / div for v in rate], color="#55A868", alpha=0.3, linewidth=0.8, label="per step"
    )
    ax.plot(
        steps,
        [v / div for v in smooth(rate, _window(len(rate)))],
        color="#55A868",
        linewidth=1.8,
        label="smoothed",
    )
    if rate:
        # the first steps include warm-up: scale the axis to the bulk of the run
        typical = sorted(rate)[int(0.98 * (len(rate) - 1))]
        ax.set_ylim(0, 1.25 * typical / div)
    ax.set(xlabel="optimizer step", ylabel=unit, title="Throughput (all ranks)")
    ax.legend(loc="lower right", frameon=False)
    return _save(fig, path)


def plot_memory(records: Records, estimate: dict[str, int] | None, path: Path) -> Path:
    """Peak bytes per rank by category as stacked bars, with the model-state estimate."""
    peaks = peak_memory(records)
    fig, ax = _figure(3.8)
    totals = [sum(p.get(c, 0) for c in CATEGORIES) for p in peaks] or [0]
    div, unit = byte_unit(max([*totals, estimate["model_states"] if estimate else 0]))
    ranks = list(range(len(peaks)))
    bottom = [0.0] * len(peaks)
    for cat in CATEGORIES:
        values = [p.get(cat, 0) / div for p in peaks]
        if any(values):
            ax.bar(ranks, values, bottom=bottom, color=COLORS[cat], width=0.6, label=cat)
            bottom = [b + v for b, v in zip(bottom, values)]
    for rank, total in zip(ranks, bottom):
        ax.annotate(
            f"{total:.1f} {unit}",
            (rank, total),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=9,
        )
    if estimate is not None:
        ax.axhline(
            estimate["model_states"] / div,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label="estimated\nparams + grads\n+ optimizer",
        )
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
    ax.set(ylabel=unit, title="Peak memory per rank (model states, measured)")
    ax.set_ylim(0, 1.15 * max([*bottom, estimate["model_states"] / div if estimate else 0]))
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("estimated"))
    ax.legend(
        [handles[i] for i in order][::-1],
        [labels[i] for i in order][::-1],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
        fontsize=9,
    )
    ax.grid(False)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_comm(records: Records, path: Path) -> Path:
    """Per step on rank 0: compute time versus exposed communication time (stacked), total
    communication time (overlapped or not), and bytes sent per collective."""
    steps = [r["step"] for r in records]
    step_time = [r.get("step_time_s") or 0.0 for r in records]
    exposed = [(r.get("exposed_comm_s") or [0.0])[0] or 0.0 for r in records]
    exposed = [min(e, t) for e, t in zip(exposed, step_time)]
    compute = [t - e for t, e in zip(step_time, exposed)]
    comm_s = [sum(op.get("seconds", 0.0) for op in (r.get("comm") or {}).values()) for r in records]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6.2), dpi=DPI, sharex=True, height_ratios=[3, 2]
    )
    w = _window(len(steps))
    top.stackplot(
        steps,
        [v * 1e3 for v in smooth(compute, w)],
        [v * 1e3 for v in smooth(exposed, w)],
        colors=["#4C72B0", "#C44E52"],
        alpha=0.8,
        labels=["computation", "exposed communication"],
    )
    # collectives in flight at the same time each count their own duration, so this sum can
    # exceed the step time (ZeRO-3 prefetch)
    top.plot(
        steps,
        [v * 1e3 for v in smooth(comm_s, w)],
        color="black",
        linewidth=1.2,
        linestyle="--",
        label="sum of collective durations (incl. overlapped)",
    )
    top.set(ylabel="ms per step", title="Step time on rank 0 (smoothed)")
    if step_time:
        peak = max(max(smooth(step_time, w)[1:] or step_time), max(smooth(comm_s, w)[1:] or [0]))
        top.set_ylim(0, 1.25 * peak * 1e3)
    top.legend(loc="upper right", frameon=False, fontsize=9)
    ops = sorted({op for r in records for op in (r.get("comm") or {})})
    per_op = [[(r.get("comm") or {}).get(op, {}).get("bytes", 0) for r in records] for op in ops]
    div, unit = byte_unit(max((sum(col) for col in zip(*per_op)), default=0))
    palette = ["#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#937860"]
    if ops:
        bottom.stackplot(
            steps,
            [[b / div for b in row] for row in per_op],
            colors=palette[: len(ops)],
            labels=ops,
            alpha=0.85,
        )
        bottom.legend(loc="upper right", frameon=False, fontsize=9, ncol=len(ops))
    bottom.set(
        xlabel="optimizer step",
        ylabel=f"{unit} per step",
        title="Bytes communicated by rank 0, per collective",
    )
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    return _save(fig, path)

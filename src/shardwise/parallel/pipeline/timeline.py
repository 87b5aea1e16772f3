"""Show a simulated step: a text timeline per rank, a summary, and a PNG chart."""

from __future__ import annotations

from pathlib import Path

from shardwise.parallel.pipeline.schedule import Kind
from shardwise.parallel.pipeline.simulate import Number, SimResult

MAX_CELLS = 160
COLORS = {Kind.F: "#4c78a8", Kind.B: "#e45756", Kind.I: "#f58518", Kind.W: "#54a24b"}


def _fmt(x: Number) -> str:
    return f"{float(x):.4g}"


def text_timeline(res: SimResult) -> list[str]:
    """One line per rank; each cell (3 characters) shows the action running at its middle,
    e.g. ``F3`` (forward of micro-batch 3), ``B3``, ``I3``, ``W3``; ``.`` is idle."""
    durations = [slot.end - slot.start for row in res.timeline for slot in row]
    cell = min((d for d in durations if d > 0), default=1)
    cells = int(res.makespan / cell + 0.5) if res.makespan else 0
    if cells > MAX_CELLS:
        cell, cells = res.makespan / MAX_CELLS, MAX_CELLS
    lines = []
    for r, row in enumerate(res.timeline):
        out, k = [], 0
        for c in range(cells):
            mid = (c + 0.5) * cell
            while k < len(row) and row[k].end <= mid:
                k += 1
            if k < len(row) and row[k].start <= mid:
                a = row[k].action
                out.append(f"{a.kind.value}{a.mb:<2}")
            else:
                out.append(" . ")
        lines.append(f"rank {r:>2} |{''.join(out).rstrip()}")
    return lines


def summary(res: SimResult) -> list[str]:
    s = res.schedule
    p, m, v = s.pp_size, s.microbatches, s.virtual_stages
    peaks = ", ".join(f"r{r}={_fmt(res.peak_activations(r))}" for r in range(p))
    return [
        f"schedule {s.name}: pp={p}, virtual stages={v}, micro-batches={m}",
        f"step time {_fmt(res.makespan)} (compute per rank {_fmt(max(res.busy))})",
        f"bubble {_fmt(res.bubble)} of the ideal time"
        + (f" (= {res.bubble})" if not isinstance(res.bubble, float) else ""),
        f"peak in-flight activations (micro-batches of one rank's layers): {peaks}",
    ]


def write_png(res: SimResult, path: Path) -> Path:
    """A Gantt chart of the step: one row per rank, one bar per compute action."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = res.schedule.pp_size
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, float(res.makespan) / 2)), 0.6 * p + 1.2))
    for r, row in enumerate(res.timeline):
        for slot in row:
            start, width = float(slot.start), float(slot.end - slot.start)
            ax.broken_barh(
                [(start, width)], (r - 0.4, 0.8), color=COLORS[slot.action.kind], edgecolor="white"
            )
            if width * 8 >= float(res.makespan) / 20:
                ax.text(
                    start + width / 2,
                    r,
                    str(slot.action.mb),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    s = res.schedule
    ax.set_title(
        f"{s.name} pp={p} v={s.virtual_stages} m={s.microbatches}: bubble {float(res.bubble):.3f}"
    )
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c)
        for k, c in COLORS.items()
        if any(slot.action.kind is k for row in res.timeline for slot in row)
    ]
    labels = [
        k.value
        for k in COLORS
        if any(slot.action.kind is k for row in res.timeline for slot in row)
    ]
    ax.legend(handles, labels, loc="upper right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    return path

"""Rank 0's view of a run while it trains.

On a terminal: a live progress bar with step / total, loss, tokens/s, step time, memory per
rank and the time left. Otherwise (a log file, a CI job): one plain log line every ``log_every``
steps with the same figures.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Iterable
from typing import Any

from rich.console import RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

from shardwise.bytesize import MiB

log = logging.getLogger("shardwise.train")


def format_duration(seconds: float) -> str:
    """``"1h02m"``, ``"3m05s"`` or ``"42s"``."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def format_rate(tokens_per_s: float) -> str:
    """``"12.3k tok/s"``."""
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M tok/s"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k tok/s"
    return f"{tokens_per_s:.0f} tok/s"


def format_memory(per_rank: list[dict[str, int]]) -> str:
    """Memory held per rank (params, grads, optimizer, buffers, comm), in MiB."""
    totals = [
        sum(m.get(k, 0) for k in ("params", "grads", "optimizer", "buffers", "comm")) / MiB
        for m in per_rank
    ]
    if not totals:
        return "-"
    if len(totals) <= 4:
        return "/".join(f"{t:.1f}" for t in totals) + " MiB"
    return f"{min(totals):.1f}-{max(totals):.1f} MiB"


class StatsProgress(RichProgress):
    """A rich progress bar with a line of figures under it (each fits 80 columns)."""

    stats = "  starting..."

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        yield Text(self.stats)


class Progress:
    """Shows training progress on rank 0.

    Args:
        total_steps: the step the run ends at.
        start_step: the step it starts (or resumes) from.
        log_every: steps between plain lines (ignored on a terminal).
        interactive: draw a live bar (default: when stdout is a terminal).
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        log_every: int = 10,
        interactive: bool | None = None,
    ) -> None:
        self.total = total_steps
        self.start = start_step
        self.log_every = log_every
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self._times: deque[float] = deque(maxlen=20)
        self._last_val: float | None = None
        self._bar: StatsProgress | None = None
        self._task: Any = None
        self._streams: list[tuple[logging.StreamHandler, Any]] = []
        if self.interactive:
            self._start_bar()

    def _start_bar(self) -> None:
        self._bar = StatsProgress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            refresh_per_second=4,
        )
        self._task = self._bar.add_task("train", total=self.total, completed=self.start)
        self._bar.start()
        # log lines go above the bar: point the logging handlers at rich's stderr proxy
        self._streams = []
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (
                sys.__stderr__,
                sys.__stdout__,
            ):
                self._streams.append((handler, handler.setStream(sys.stderr)))

    def _eta_s(self, step: int) -> float:
        mean = sum(self._times) / len(self._times) if self._times else 0.0
        return mean * (self.total - step)

    def _stats(self, record: dict[str, Any]) -> str:
        parts = [f"loss {record['loss']:.3f}"]
        if self._last_val is not None:
            parts.append(f"val {self._last_val:.3f}")
        parts += [
            format_rate(record["tokens_per_s"]),
            f"{record['step_time_s']:.2f} s/step",
            f"mem {format_memory(record['memory'])}",
        ]
        return " | ".join(parts)

    def update(self, record: dict[str, Any]) -> None:
        """Show one step record (see ``metrics.py`` for its keys)."""
        step = record["step"]
        self._times.append(record["step_time_s"])
        if record.get("val_loss") is not None:
            self._last_val = record["val_loss"]
        if self._bar is not None:
            self._bar.stats = "  " + self._stats(record)
            self._bar.update(self._task, completed=step)
        elif step % self.log_every == 0 or step == self.total or "val_loss" in record:
            log.info(
                "step %d/%d | lr %.2e | %s | eta %s",
                step,
                self.total,
                record["lr"],
                self._stats(record),
                format_duration(self._eta_s(step)),
            )

    def message(self, text: str) -> None:
        """A line above the bar (or a log line)."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            log.info("%s", text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            for handler, stream in self._streams:
                handler.setStream(stream)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

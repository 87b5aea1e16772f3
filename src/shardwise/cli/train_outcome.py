"""What ``shardwise train`` says when a run ends: how it went and where to look, and whether
stopping it wrote a checkpoint."""

from __future__ import annotations

import signal
import sys

from shardwise.cli.run_agent import LaunchResult
from shardwise.train.progress import format_duration, format_rate
from shardwise.train.rundir import RunDir
from shardwise.train.summary import read_summary

EXIT_KILLED = 128 + 9
"""Exit code when a stop signal's grace period ran out and the ranks were killed."""


def newest_checkpoint(run_dir: RunDir) -> int | None:
    from shardwise.checkpoint.journal import Journal

    journal = Journal(run_dir.checkpoints)
    if not journal.exists():
        return None
    live = journal.read().live_steps()
    return live[-1] if live else None


def report(run_dir: RunDir, code: int, started: float) -> None:
    """The last lines on the terminal: how the run went and where to look."""
    summary = read_summary(run_dir.summary)
    if summary is None or run_dir.summary.stat().st_mtime < started:
        print(f"shardwise train: the run wrote no summary (exit code {code})")
        print(f"run directory: {run_dir.root}")
        return
    val, base = summary.get("final_val_loss"), summary["unigram_baseline"]
    val_text = "n/a" if val is None else f"{val:.3f}"
    rate = summary.get("tokens_per_s")
    print(
        f"{summary['status']} at step {summary['steps']}: validation loss {val_text} nats"
        + ("" if base is None else f" (unigram baseline {base:.3f})")
        + f", {format_rate(rate) if rate else 'n/a'} at "
        f"{summary['world_size']} ranks, wall time {format_duration(summary['wall_time_s'])}"
    )
    print(f"run directory: {run_dir.root}")
    print(
        f"plots: shardwise report {run_dir.root}    sample: shardwise generate "
        f"{run_dir.root} --prompt 'def '"
    )


def stop_message(run_dir: RunDir, result: LaunchResult, before: int | None) -> int:
    """Say whether stopping wrote a checkpoint; returns the exit code (128 + the signal when
    it did, 137 when the ranks had to be killed)."""
    after = newest_checkpoint(run_dir)
    name = (result.stop_signal or signal.Signals(result.code - 128)).name
    if result.killed:
        kept = "the run has none" if after is None else f"the newest is step {after}"
        print(
            f"shardwise train: stopped by {name}; the ranks did not finish within the grace "
            f"period and were killed: no checkpoint was written ({kept}); "
            "raise --grace-period-s to let them save",
            file=sys.stderr,
        )
        return EXIT_KILLED
    written = after is not None and after != before
    what = f"checkpoint of step {after} written" if written else "no new checkpoint written"
    print(f"shardwise train: stopped by {name}: {what}", file=sys.stderr)
    return result.code

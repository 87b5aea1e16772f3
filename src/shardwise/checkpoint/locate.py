"""Finding checkpoints: the journal, not the directory listing, says which steps exist."""

from __future__ import annotations

from pathlib import Path

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.journal import Journal, JournalState
from shardwise.checkpoint.layout import JOURNAL_NAME, parse_step_dir, step_dir_name


def split_step_path(path: Path | str) -> tuple[Path, int]:
    """``root/step-00000100`` -> ``(root, 100)``; CheckpointError for any other name."""
    p = Path(path)
    step = parse_step_dir(p)
    if step is None:
        raise CheckpointError(
            "not a checkpoint directory (expected a name like step-00000100; "
            "pass the checkpoint root to resolve() to find one)",
            p,
        )
    return p.parent, step


def resolve(root_or_path: Path | str, which: str | int = "latest") -> Path:
    """The directory of one committed checkpoint.

    Args:
        root_or_path: a checkpoint root (holding ``journal.log``), or a ``step-N`` directory,
            which is returned as is (``verify`` checks that it exists and is committed).
        which: ``"latest"`` (the newest committed step) or a step number.

    Raises:
        CheckpointError: no journal, no committed checkpoint, or step ``which`` not committed.
        ValueError: ``which`` is neither ``"latest"`` nor an int.
    """
    p = Path(root_or_path)
    if parse_step_dir(p) is not None:
        return p
    journal = Journal(p)
    if not journal.exists():
        raise CheckpointError(
            f"no {JOURNAL_NAME}: not a checkpoint root, or nothing was ever committed there",
            journal.path,
        )
    live = journal.read().live_steps()
    if which == "latest":
        if not live:
            raise CheckpointError("the journal has no committed checkpoint", journal.path)
        return p / step_dir_name(live[-1])
    if isinstance(which, bool) or not isinstance(which, int):
        raise ValueError(f"which must be 'latest' or a step number, got {which!r}")
    if which not in live:
        raise CheckpointError(
            f"step {which} is not committed; committed steps: {live}", journal.path
        )
    return p / step_dir_name(which)


def commit_problem(state: JournalState, step: int) -> str | None:
    """Why the journal does not vouch for ``step`` (None when it has a valid commit)."""
    if step in state.committed:
        return None
    damaged = state.damaged_for(step)
    if damaged is not None:
        return (
            f"line {damaged.line_no} (a record of step {step}) is damaged "
            f"({damaged.reason}); the commit of step {step} cannot be trusted"
        )
    if step in state.deleted:
        return f"step {step} was deleted (retention or delete_checkpoint)"
    if state.torn_step in (step, -1):
        return (
            f"no commit record for step {step}: the last line is torn (the process died "
            f"while appending it), so the save was never committed"
        )
    if step in state.pending:
        return f"step {step} was begun but never committed (the save was interrupted)"
    return f"no record of step {step}: it was never committed"

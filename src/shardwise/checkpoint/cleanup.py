"""Removing what the journal says does not exist: interrupted saves, retired checkpoints.

Only the committing rank runs these, and only one writer may use a checkpoint root at a time.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from shardwise.checkpoint.durable import fsync_dir
from shardwise.checkpoint.journal import Journal, JournalState
from shardwise.checkpoint.layout import parse_step_dir, parse_tmp_dir, step_dir_name

log = logging.getLogger("shardwise.checkpoint")


def clean_leftovers(journal: Journal) -> list[Path]:
    """Repair a torn journal tail and delete leftovers of interrupted saves and deletions.

    Deleted: every ``.tmp-step-*`` directory (a save that never reached its rename), and every
    ``step-N`` directory the journal shows begun but not committed (a crash between the rename
    and the commit record) or deleted (a crash while deleting). A ``step-N`` directory the
    journal has no record of, or whose record is damaged, is left alone with a warning: readers
    ignore it, but it may hold data someone wants to recover.

    Returns:
        The paths removed.
    """
    journal.repair()
    state = journal.read()
    removed = []
    for path in sorted(journal.root.iterdir()):
        if not path.is_dir():
            continue
        tmp_step, step = parse_tmp_dir(path), parse_step_dir(path)
        if tmp_step is not None:
            why = "interrupted save (never renamed)"
        elif step is not None and step in state.committed:
            continue
        elif step is not None and step in state.deleted:
            why = "deletion"
        elif step is not None and step in state.pending and state.damaged_for(step) is None:
            why = "interrupted save (renamed, never committed)"
        else:
            if step is not None:  # unknown to the journal, or its record is damaged: keep it
                log.warning(
                    "%s: not committed in %s; ignored by readers and left in place",
                    path,
                    journal.path.name,
                )
            continue
        log.warning("%s: removing leftover of an %s", path, why)
        shutil.rmtree(path)
        removed.append(path)
    if removed:
        fsync_dir(journal.root)
    return removed


def delete_checkpoint(root: Path | str, step: int) -> None:
    """Retire committed step ``step``: journal ``delete`` record first, then remove the files.

    Once the record is written the checkpoint no longer exists for readers, even if removing
    its directory is interrupted (the next save finishes the removal). No distributed setup is
    needed; do not run it while a save to ``root`` is in progress.

    Raises:
        ValueError: the journal has no committed step ``step``.
    """
    journal = Journal(root)
    state = journal.read()
    if step not in state.committed:
        live = state.live_steps()
        raise ValueError(
            f"step {step} is not a committed checkpoint in {journal.root}; committed steps: {live}"
        )
    journal.append("delete", step)
    path = journal.root / step_dir_name(step)
    shutil.rmtree(path, ignore_errors=True)
    fsync_dir(journal.root)
    log.info("%s: deleted", path)


def apply_retention(root: Path | str, keep_last: int, state: JournalState) -> list[int]:
    """Delete committed steps older than the newest ``keep_last``; returns the steps deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    doomed = state.live_steps()[:-keep_last]
    for step in doomed:
        delete_checkpoint(root, step)
    return doomed

"""Retiring steps: interrupted saves and retention remove them, damaged ones are set aside;
:func:`prepare_resume` readies a root for resuming (rebuilt journal, damaged steps aside).

Only the committing rank runs these, and only one writer may use a checkpoint root at a time.
Every retirement of a committed step writes the journal's ``delete`` record first: from then on
the step does not exist for readers, even if what follows (removing or renaming its directory)
is interrupted.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from shardwise.checkpoint.files import fsync_dir
from shardwise.checkpoint.integrity import find_latest_valid, rebuild_journal
from shardwise.checkpoint.journal import Journal
from shardwise.checkpoint.layout import (
    parse_step_dir,
    parse_tmp_dir,
    set_aside_name,
    step_dir_name,
)

log = logging.getLogger("shardwise.checkpoint")

REASON_FILE = "SET_ASIDE.txt"
"""Written into a set-aside directory: why and when it was set aside."""


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


def _committed(journal: Journal, step: int) -> bool:
    state = journal.read()
    if step in state.committed:
        return True
    if not (journal.root / step_dir_name(step)).is_dir():
        raise ValueError(
            f"step {step} is not a committed checkpoint in {journal.root} and has no "
            f"directory there; committed steps: {state.live_steps()}"
        )
    return False


def delete_checkpoint(root: Path | str, step: int) -> None:
    """Retire committed step ``step``: journal ``delete`` record first, then remove the files.

    No distributed setup is needed; do not run it while a save to ``root`` is in progress.

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


def set_aside(root: Path | str, step: int, reason: str) -> Path:
    """Rename ``step-N`` to ``damaged-step-N`` (kept for inspection, with ``reason`` in
    ``SET_ASIDE.txt``), so that training can save step N again.

    A committed step gets the journal's ``delete`` record (naming the new directory) first. A
    step directory the journal does not vouch for is only renamed. Returns the new path.

    Raises:
        ValueError: step ``step`` is neither committed nor a directory under ``root``.
    """
    journal = Journal(root)
    src = journal.root / step_dir_name(step)
    attempt = 0
    while (journal.root / set_aside_name(step, attempt)).exists():
        attempt += 1
    dst = journal.root / set_aside_name(step, attempt)
    if _committed(journal, step):
        journal.append("delete", step, set_aside=dst.name)
    if src.is_dir():
        os.rename(src, dst)
        (dst / REASON_FILE).write_text(f"step {step} set aside: {reason}\n", encoding="utf-8")
    fsync_dir(journal.root)
    log.warning("%s: set aside as %s (%s)", src, dst.name, reason)
    return dst


def apply_retention(root: Path | str, keep_last: int) -> list[int]:
    """Delete committed steps older than the newest ``keep_last``; returns the steps deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    doomed = Journal(root).read().live_steps()[:-keep_last]
    for step in doomed:
        delete_checkpoint(root, step)
    return doomed


def prepare_resume(root: Path | str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """Get ``root`` ready for a resume; run by one process (the committing rank).

    A root with step directories but no ``journal.log`` gets its journal rebuilt from their
    manifests (:func:`~shardwise.checkpoint.integrity.rebuild_journal`). Then the newest step
    that verifies is found (:func:`~shardwise.checkpoint.integrity.find_latest_valid`), and
    every newer step that does not verify is set aside (:func:`set_aside`), so that training
    saves those steps again; an interrupted save is left to the next save, which removes it.

    Returns:
        ``(the step directory to resume from or None, [(skipped path, reason), ...])``.
    """
    root = Path(root)
    steps = [parse_step_dir(p) for p in root.iterdir()] if root.is_dir() else []
    if not Journal(root).exists() and any(s is not None for s in steps):
        log.warning(
            "%s has step directories but no journal: rebuilding it from their manifests "
            "(only steps whose files all verify)",
            root,
        )
        rebuild_journal(root)
    found, skipped = find_latest_valid(root)
    state = Journal(root).read()
    newest = -1 if found is None else parse_step_dir(found)
    for path, why in skipped:
        step = parse_step_dir(path)
        assert step is not None and newest is not None
        interrupted = step in state.pending and state.damaged_for(step) is None
        if step > newest and not interrupted and path.is_dir():
            set_aside(root, step, f"it does not verify: {why}")
    return found, skipped

"""The write-ahead journal: the single source of truth for which checkpoints exist.

:func:`resolve` is the one place that turns "a checkpoint root or a step directory" into a step
directory; :func:`commit_problem` says why the journal does not vouch for a step.

``root/journal.log`` is append-only text, one record per line::

    <crc32 of the JSON, 8 hex digits> <JSON object>\n

with JSON ``{"op": "begin" | "commit" | "delete", "step": N, "time_unix_s": ...}`` and, for
``commit``, ``"manifest_sha256"``. Every append is flushed and fsynced before the caller goes on.

* ``begin N`` is written before any file of step N.
* ``commit N manifest_sha256=...`` is written after ``step-N`` was renamed into place: from
  that moment (and only then) step N exists.
* ``delete N`` is written before step N's directory is removed: from then on it does not exist.

A crash while appending leaves a last line without its newline (torn): that record never
happened, and the next writer truncates it away. A complete line whose checksum does not match
is damaged: it is reported, never trusted, so a step whose commit record is damaged is not valid.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.checkpoint.files import fsync_dir
from shardwise.checkpoint.layout import (
    JOURNAL_NAME,
    CheckpointError,
    parse_step_dir,
    step_dir_name,
)

log = logging.getLogger("shardwise.checkpoint")

OPS = ("begin", "commit", "delete")
_STEP_RE = re.compile(rb'"step":\s*(\d+)')


@dataclass(frozen=True)
class JournalRecord:
    """A record whose checksum matched."""

    op: str
    step: int
    line_no: int
    manifest_sha256: str | None = None
    set_aside: str | None = None
    """On a ``delete`` record: the directory the step was renamed to (kept, not removed)."""


@dataclass(frozen=True)
class DamagedLine:
    """A complete line that cannot be trusted; ``claimed_step`` is a best-effort guess."""

    line_no: int
    reason: str
    claimed_step: int | None


@dataclass
class JournalState:
    """Everything a journal says, folded: which steps are live, pending, deleted."""

    path: Path
    records: list[JournalRecord] = field(default_factory=list)
    damaged: list[DamagedLine] = field(default_factory=list)
    torn_step: int | None = None
    """Best-effort step of a torn last line (-1 if it names none); None: the tail is intact."""
    valid_bytes: int = 0
    """Length of the journal up to and including its last complete line."""
    committed: dict[int, JournalRecord] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    deleted: set[int] = field(default_factory=set)
    set_aside: dict[int, str] = field(default_factory=dict)
    """Deleted steps whose directory was renamed (kept for inspection) -> the new name."""

    @property
    def torn(self) -> bool:
        return self.torn_step is not None

    def fold(self) -> None:
        """Replay ``records`` in order into ``committed``, ``pending`` and ``deleted``."""
        self.committed, self.pending, self.deleted, self.set_aside = {}, set(), set(), {}
        for rec in self.records:
            if rec.op == "begin":
                self.pending.add(rec.step)
                self.deleted.discard(rec.step)
            elif rec.op == "commit":
                self.committed[rec.step] = rec
                self.pending.discard(rec.step)
            else:
                self.committed.pop(rec.step, None)
                self.pending.discard(rec.step)
                self.deleted.add(rec.step)
                if rec.set_aside is not None:
                    self.set_aside[rec.step] = rec.set_aside

    def live_steps(self) -> list[int]:
        """Committed, not deleted steps, oldest first."""
        return sorted(self.committed)

    def damaged_for(self, step: int) -> DamagedLine | None:
        """The last damaged line that seems to be about ``step``."""
        hits = [d for d in self.damaged if d.claimed_step == step]
        return hits[-1] if hits else None


def _claimed_step(raw: bytes) -> int | None:
    m = _STEP_RE.search(raw)
    return int(m.group(1)) if m else None


def _parse_line(raw: bytes, line_no: int) -> JournalRecord | DamagedLine:
    crc_hex, _, payload = raw.partition(b" ")
    try:
        expected = int(crc_hex, 16)
    except ValueError:
        return DamagedLine(line_no, "no checksum prefix", _claimed_step(raw))
    if len(crc_hex) != 8 or zlib.crc32(payload) != expected:
        return DamagedLine(line_no, "checksum mismatch", _claimed_step(raw))
    try:
        doc = json.loads(payload)
        op, step = doc["op"], doc["step"]
        if op not in OPS or not isinstance(step, int) or step < 0:
            raise ValueError(f"bad op {op!r} or step {step!r}")
        sha = doc.get("manifest_sha256")
        if op == "commit" and not isinstance(sha, str):
            raise ValueError("commit record without manifest_sha256")
    except (ValueError, KeyError, TypeError) as exc:
        return DamagedLine(line_no, f"unreadable record ({exc})", _claimed_step(raw))
    aside = doc.get("set_aside") if op == "delete" else None
    if aside is not None and not isinstance(aside, str):
        return DamagedLine(line_no, "unreadable record (set_aside)", step)
    return JournalRecord(op, step, line_no, sha if op == "commit" else None, aside)


def encode_record(op: str, step: int, **fields: Any) -> bytes:
    """One journal line (with its checksum and newline) for ``op`` on ``step``."""
    if op not in OPS:
        raise ValueError(f"unknown journal op {op!r}; allowed: {', '.join(OPS)}")
    doc = {"op": op, "step": step, "time_unix_s": round(time.time(), 3), **fields}
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


class Journal:
    """``root/journal.log``. Only one process (the committing rank) appends to it."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.path = self.root / JOURNAL_NAME

    def exists(self) -> bool:
        return self.path.is_file()

    def read(self) -> JournalState:
        """Parse the journal (a missing one is empty). Never raises for damaged content."""
        state = JournalState(self.path)
        data = self.path.read_bytes() if self.exists() else b""
        lines = data.split(b"\n")
        tail = lines.pop()  # after the last newline: b"" when the file ends cleanly
        if tail:
            state.torn_step = _claimed_step(tail) if _claimed_step(tail) is not None else -1
        state.valid_bytes = len(data) - len(tail)
        for i, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            parsed = _parse_line(raw, i)
            if isinstance(parsed, DamagedLine):
                state.damaged.append(parsed)
            else:
                state.records.append(parsed)
        state.fold()
        return state

    def repair(self) -> bool:
        """Truncate a torn last line (a crash during append). Returns True if it cut one."""
        state = self.read()
        if not state.torn:
            return False
        log.warning(
            "%s: dropping a torn last record (%d bytes) left by an interrupted append",
            self.path,
            self.path.stat().st_size - state.valid_bytes,
        )
        with open(self.path, "r+b") as f:
            f.truncate(state.valid_bytes)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return True
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def append(self, op: str, step: int, **fields: Any) -> None:
        """Append one record; returns once it is on stable storage (file and directory)."""
        line = encode_record(op, step, **fields)
        created = not self.exists()
        if not created and not self._ends_with_newline():
            self.repair()
        with open(self.path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if created:
            fsync_dir(self.root)


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
    if step in state.set_aside:
        return f"step {step} was set aside as damaged (kept as {state.set_aside[step]})"
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

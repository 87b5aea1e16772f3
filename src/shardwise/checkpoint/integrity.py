"""Checking a checkpoint end to end: journal commit, manifest, every file's size and sha256.

Also what depends on that verdict: :func:`find_latest_valid` (the newest checkpoint that
verifies, for resuming) and :func:`rebuild_journal` (a lost journal rebuilt from the manifests
of the step directories whose files all verify).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from shardwise.checkpoint.files import sha256_file
from shardwise.checkpoint.journal import Journal, commit_problem, resolve
from shardwise.checkpoint.layout import (
    MANIFEST_NAME,
    CheckpointError,
    member,
    parse_step_dir,
    split_step_path,
    step_dir_name,
)
from shardwise.checkpoint.manifest import Manifest, parse_manifest

log = logging.getLogger("shardwise.checkpoint")


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked, for a checkpoint that passed."""

    path: Path
    step: int
    world_size: int
    format_version: int
    manifest_sha256: str
    num_tensors: int
    num_files: int
    bytes_checked: int


def read_manifest(step_dir: Path) -> tuple[Manifest, str]:
    """Parse ``step_dir/manifest.json``; returns the manifest and the sha256 of its bytes.

    Raises:
        CheckpointError naming the manifest: missing, truncated, malformed, unknown version.
    """
    path = step_dir / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointError("manifest is missing", path) from exc
    manifest = parse_manifest(data, path)
    _, step = split_step_path(step_dir)
    if manifest.step != step:
        raise CheckpointError(
            f"manifest says step {manifest.step} but its directory is step {step}", path
        )
    return manifest, hashlib.sha256(data).hexdigest()


def committed_manifest_sha256(step_dir: Path) -> str:
    """The manifest sha256 in the journal's commit record of this step.

    Raises:
        CheckpointError naming the journal: missing, or no intact commit record for the step
            (never begun, interrupted, deleted, torn or damaged record).
    """
    root, step = split_step_path(step_dir)
    journal = Journal(root)
    if not journal.exists():
        raise CheckpointError(
            "journal is missing: no checkpoint under this root is committed", journal.path
        )
    state = journal.read()
    problem = commit_problem(state, step)
    if problem is not None:
        raise CheckpointError(problem, journal.path)
    recorded = state.committed[step].manifest_sha256
    assert recorded is not None
    return recorded


def check_manifest_sha256(step_dir: Path, actual: str, recorded: str) -> None:
    """The manifest must be the one the journal committed."""
    if actual != recorded:
        raise CheckpointError(
            f"sha256 {actual} does not match {recorded} recorded by the "
            f"journal's commit record (the manifest changed after the "
            f"commit)",
            step_dir / MANIFEST_NAME,
        )


def check_file(step_dir: Path, name: str, size: int, sha256: str) -> Path:
    """Check one file's name (plain, inside ``step_dir``), presence, size and sha256; return
    its path. CheckpointError naming it otherwise."""
    path = member(step_dir, name)
    if not path.is_file():
        raise CheckpointError("file is missing", path)
    actual_size = path.stat().st_size
    if actual_size != size:
        raise CheckpointError(
            f"size is {actual_size} bytes, the manifest says {size} (truncated or overwritten)",
            path,
        )
    _, actual = sha256_file(path)
    if actual != sha256:
        raise CheckpointError(
            f"wrong checksum: sha256 {actual}, the manifest says {sha256} (the file is damaged)",
            path,
        )
    return path


def verify(path: Path | str) -> VerifyReport:
    """Check a checkpoint completely; read every byte of it.

    Args:
        path: a ``step-N`` directory, or a checkpoint root (its latest committed step).

    Checks, in order: the directory is a step directory; the journal holds an intact commit
    record for the step; ``manifest.json`` exists, parses and has a known format_version; its
    sha256 matches the commit record's; every file the manifest lists exists with its size and
    sha256.

    Raises:
        CheckpointError naming the exact file and the problem.
    """
    step_dir = resolve(path)
    recorded = committed_manifest_sha256(step_dir)
    if not step_dir.is_dir():
        raise CheckpointError("checkpoint directory is missing", step_dir)
    manifest, manifest_sha = read_manifest(step_dir)
    check_manifest_sha256(step_dir, manifest_sha, recorded)
    total = 0
    for name in sorted(manifest.files):
        record = manifest.files[name]
        check_file(step_dir, name, record.size, record.sha256)
        total += record.size
    return VerifyReport(
        step_dir,
        manifest.step,
        manifest.world_size,
        manifest.format_version,
        manifest_sha,
        len(manifest.tensors),
        len(manifest.files),
        total,
    )


def find_latest_valid(root: Path | str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` that is committed and verifies, for auto-resume.

    Candidates are the committed steps and any ``step-N`` directory on disk, newest first;
    each newer one that fails is skipped (logged as a warning with the reason).

    Returns:
        ``(path or None when nothing verifies, [(skipped path, reason), ...])``.
    """
    root = Path(root)
    state = Journal(root).read()
    on_disk = [parse_step_dir(p) for p in root.iterdir()] if root.is_dir() else []
    candidates = sorted({s for s in on_disk if s is not None} | set(state.committed), reverse=True)
    skipped: list[tuple[Path, str]] = []
    for step in candidates:
        path = root / step_dir_name(step)
        try:
            verify(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
            skipped.append((path, str(exc)))
            continue
        return path, skipped
    return None, skipped


def _verified_manifest_sha(step_dir: Path) -> str:
    manifest, sha = read_manifest(step_dir)
    for name in sorted(manifest.files):
        record = manifest.files[name]
        check_file(step_dir, name, record.size, record.sha256)
    return sha


def rebuild_journal(root: Path | str) -> list[int]:
    """Write a new ``journal.log`` for a root whose journal is lost: a ``begin`` and a
    ``commit`` record for every ``step-N`` directory whose manifest and files all verify
    (oldest first); the others are left out with a warning. Returns the steps committed.

    Raises:
        ValueError: ``root`` still has its journal (never overwritten) or is not a directory.
    """
    journal = Journal(root)
    if journal.exists():
        raise ValueError(f"{journal.path} exists; a journal is only rebuilt when it is lost")
    if not journal.root.is_dir():
        raise ValueError(f"{journal.root} is not a directory")
    steps = sorted(s for s in map(parse_step_dir, journal.root.iterdir()) if s is not None)
    kept = []
    for step in steps:
        step_dir = journal.root / step_dir_name(step)
        try:
            sha = _verified_manifest_sha(step_dir)
        except CheckpointError as exc:
            log.warning("rebuilding %s: leaving out %s: %s", journal.path, step_dir, exc)
            continue
        journal.append("begin", step)
        journal.append("commit", step, manifest_sha256=sha, rebuilt=True)
        kept.append(step)
    log.warning("rebuilt %s from the manifests: committed steps %s", journal.path, kept)
    return kept

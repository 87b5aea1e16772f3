"""Checking a checkpoint end to end: journal commit, manifest, every file's size and sha256."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from shardwise.checkpoint.durable import sha256_file
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.journal import Journal
from shardwise.checkpoint.layout import MANIFEST_NAME, parse_step_dir
from shardwise.checkpoint.locate import commit_problem, resolve, split_step_path
from shardwise.checkpoint.manifest import Manifest, parse_manifest


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


def check_file(path: Path, size: int, sha256: str) -> None:
    """Check one data file's presence, size and sha256; CheckpointError naming it otherwise."""
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
    step_dir = Path(path) if parse_step_dir(path) is not None else resolve(path)
    recorded = committed_manifest_sha256(step_dir)
    if not step_dir.is_dir():
        raise CheckpointError("checkpoint directory is missing", step_dir)
    manifest, manifest_sha = read_manifest(step_dir)
    check_manifest_sha256(step_dir, manifest_sha, recorded)
    total = 0
    for name in sorted(manifest.files):
        record = manifest.files[name]
        check_file(step_dir / name, record.size, record.sha256)
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

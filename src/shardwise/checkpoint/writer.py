"""Saving a checkpoint: every rank writes its files, rank 0 commits them atomically.

Protocol (ranks are group ranks; "rank 0" is the committing rank):

1. rank 0 repairs a torn journal tail, removes leftovers of interrupted saves, appends
   ``begin N`` to the journal and creates ``root/.tmp-step-N/``; it broadcasts the outcome
   (this doubles as the barrier).
2. every rank writes its shard file and its rank-state file into the temp directory, fsyncs
   them and (``verify_writes``) reads them back to check their sha256.
3. ``all_gather_object`` of every rank's box and file metadata (or its error).
4. rank 0 checks that the boxes of every tensor cover it exactly once, writes
   ``manifest.json.tmp``, fsyncs, renames it to ``manifest.json``, renames the temp directory to
   ``root/step-N`` (atomic), fsyncs ``root``, appends ``commit N manifest_sha256=...``, applies
   retention, and broadcasts the outcome: every rank returns or raises together.

A crash anywhere before the commit record leaves step N nonexistent for readers; the next save
removes its leftovers. Saving a step that is already committed is an error: checkpoints are
immutable; retire the old one with :func:`~shardwise.checkpoint.cleanup.delete_checkpoint`.
An error on any rank (bad entries, a failed write, a coverage gap) is raised on every rank.

``root`` must be one directory that every rank sees (a shared filesystem), and only one save
may run on a root at a time (a save removes the temp directories of interrupted ones).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.checkpoint.entries import ShardEntry, prepare_entries
from shardwise.checkpoint.faults import crash_point, maybe_crash, maybe_stall
from shardwise.checkpoint.files import (
    dtype_name,
    fsync_dir,
    sha256_file,
    write_bytes_durably,
    write_shard_file,
)
from shardwise.checkpoint.journal import Journal
from shardwise.checkpoint.layout import (
    MANIFEST_NAME,
    MANIFEST_TMP_NAME,
    CheckpointError,
    rank_state_file_name,
    shard_file_name,
    step_dir_name,
    tensor_key,
    tmp_dir_name,
)
from shardwise.checkpoint.manifest import FileRecord, PieceMeta, RankMeta, build_manifest
from shardwise.checkpoint.rank_state import encode_rank_state
from shardwise.checkpoint.retention import apply_retention, clean_leftovers
from shardwise.comm import Group, objects

log = logging.getLogger("shardwise.checkpoint")

_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


@dataclass(frozen=True)
class _Failure:
    """An error on one rank, sent to the others so that every rank raises it."""

    rank: int
    kind: str
    message: str

    @classmethod
    def of(cls, rank: int, exc: Exception) -> _Failure:
        return cls(rank, type(exc).__name__, str(exc))

    def exception(self) -> Exception:
        text = f"checkpoint save failed on rank {self.rank}: {self.message}"
        return _KINDS.get(self.kind, CheckpointError)(text)


def check_trainer_state(trainer_state: dict[str, Any]) -> dict[str, Any]:
    """Return a deep copy of ``trainer_state`` made through JSON, or raise ValueError."""
    if not isinstance(trainer_state, dict):
        raise TypeError(f"trainer_state must be a dict, got {type(trainer_state).__name__}")
    try:
        return json.loads(json.dumps(trainer_state))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"trainer_state must be JSON-serializable (str keys, numbers, strings, "
            f"lists, dicts); put other objects into rank_state: {exc}"
        ) from exc


def _begin(root: Path, step: int, trainer_state: dict[str, Any]) -> _Failure | None:
    """Rank 0, phase 1: clean up, journal ``begin``, create the temp directory."""
    try:
        check_trainer_state(trainer_state)
        root.mkdir(parents=True, exist_ok=True)
        journal = Journal(root)
        clean_leftovers(journal)
        state = journal.read()
        final = root / step_dir_name(step)
        if step in state.committed:
            raise ValueError(
                f"step {step} is already committed at {final}; checkpoints are "
                f"immutable: save under another step, or retire it first with "
                f"shardwise.checkpoint.delete_checkpoint(root, {step}) or "
                f"shardwise.checkpoint.set_aside(root, {step}, reason)"
            )
        if final.exists():
            raise ValueError(
                f"{final} exists but {journal.path} has no valid commit record for "
                f"it; move it away or save under another step"
            )
        journal.append("begin", step)
        (root / tmp_dir_name(step)).mkdir()
        fsync_dir(root)
    except Exception as exc:
        return _Failure.of(0, exc)
    return None


def _check_written(path: Path, size: int, sha: str) -> None:
    got_size, got_sha = sha256_file(path)
    if (got_size, got_sha) != (size, sha):
        raise CheckpointError(
            f"read back {got_size} bytes with sha256 {got_sha}, but wrote "
            f"{size} bytes with sha256 {sha} (storage problem)",
            path,
        )


def _write_rank_files(
    tmp: Path,
    rank: int,
    world: int,
    entries: list[ShardEntry],
    rank_state_blob: bytes,
    verify_writes: bool,
) -> RankMeta:
    """Every rank, phase 2: write and fsync this rank's shard and rank-state files."""
    shard_name = shard_file_name(rank, world)
    pieces = [(tensor_key(e.name, e.offsets), e.tensor) for e in entries if e.tensor.numel()]
    midway = (lambda: maybe_crash("mid_file", rank)) if crash_point() == "mid_file" else None
    shard_size, shard_sha = write_shard_file(tmp / shard_name, pieces, midway)
    state_name = rank_state_file_name(rank)
    state_sha = write_bytes_durably(tmp / state_name, rank_state_blob)
    if verify_writes:
        _check_written(tmp / shard_name, shard_size, shard_sha)
        _check_written(tmp / state_name, len(rank_state_blob), state_sha)
    metas = tuple(
        PieceMeta(
            e.name,
            e.global_shape,
            dtype_name(e.tensor.dtype),
            e.offsets,
            tuple(e.tensor.shape),
            shard_name,
            tensor_key(e.name, e.offsets),
        )
        for e in entries
    )
    files = (
        FileRecord(shard_name, rank, "shard", shard_size, shard_sha),
        FileRecord(state_name, rank, "rank_state", len(rank_state_blob), state_sha),
    )
    return RankMeta(rank, metas, files, state_name)


def _commit(
    root: Path,
    step: int,
    metas: list[RankMeta],
    trainer_state: dict[str, Any],
    keep_last: int | None,
) -> _Failure | None:
    """Rank 0, phase 4: manifest, atomic rename, journal ``commit``, retention."""
    tmp, final = root / tmp_dir_name(step), root / step_dir_name(step)
    try:
        manifest = build_manifest(step, metas, check_trainer_state(trainer_state))
        data = manifest.to_json()
        sha = write_bytes_durably(tmp / MANIFEST_TMP_NAME, data)
        os.replace(tmp / MANIFEST_TMP_NAME, tmp / MANIFEST_NAME)
        fsync_dir(tmp)  # every rank's file entries and the manifest's
        os.rename(tmp, final)
        fsync_dir(root)
        maybe_crash("during_rename", 0)
        Journal(root).append("commit", step, manifest_sha256=sha)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return _Failure.of(0, exc)
    log.info(
        "rank 0: committed step %d at %s (%d tensors, %d files)",
        step,
        final,
        len(manifest.tensors),
        len(manifest.files),
    )
    if keep_last is not None:
        try:
            apply_retention(root, keep_last)
        except OSError as exc:  # the new checkpoint is committed: do not fail the save
            log.warning("rank 0: retention (keep_last=%d) in %s failed: %s", keep_last, root, exc)
    return None


def save_snapshot(
    root: Path | str,
    step: int,
    entries: list[ShardEntry],
    trainer_state: dict[str, Any],
    rank_state_blob: bytes,
    *,
    keep_last: int | None = None,
    group: Group,
    verify_writes: bool = True,
    local_error: Exception | None = None,
) -> Path:
    """Run the save protocol on already prepared entries and an encoded rank state.

    ``local_error`` is an error this rank hit while preparing: it is raised on every rank
    without deadlocking the others. See :func:`save_checkpoint` for the rest.
    """
    g = group
    if not g.is_member:
        raise ValueError(f"this rank is not a member of {g}; call save on the group's ranks")
    root, me = Path(root), g.rank
    tmp = root / tmp_dir_name(step)
    failure = _begin(root, step, trainer_state) if me == 0 else None
    failure = objects.broadcast_object(failure, src=g.ranks[0], group=g)
    if failure is not None:
        raise failure.exception()
    maybe_crash("before_files", me)
    maybe_stall()
    own_error = local_error
    meta: RankMeta | _Failure
    try:
        if own_error is not None:
            raise own_error
        meta = _write_rank_files(tmp, me, g.size, entries, rank_state_blob, verify_writes)
        maybe_crash("after_files", me)
    except Exception as exc:
        own_error, meta = exc, _Failure.of(me, exc)
    gathered = objects.all_gather_object(meta, group=g)
    failures = [m for m in gathered if isinstance(m, _Failure)]
    if failures:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if own_error is not None:
            raise own_error
        raise failures[0].exception()
    outcome = _commit(root, step, gathered, trainer_state, keep_last) if me == 0 else None
    outcome = objects.broadcast_object(outcome, src=g.ranks[0], group=g)
    if outcome is not None:
        raise outcome.exception()
    return root / step_dir_name(step)


def save_checkpoint(
    root: Path | str,
    step: int,
    entries: list[ShardEntry],
    trainer_state: dict[str, Any],
    rank_state: Any,
    keep_last: int | None = None,
    *,
    group: Group,
    verify_writes: bool = True,
) -> Path:
    """Save a sharded checkpoint of step ``step`` under ``root``; call it on every rank.

    Args:
        root: checkpoint root on a filesystem every rank sees; created if missing.
        step: training step (>= 0); the checkpoint lands in ``root/step-{step:08d}``. A step
            that is already committed raises ValueError (checkpoints are immutable).
        entries: this rank's boxes; over all ranks they must cover each tensor exactly once.
        trainer_state: JSON-serializable dict stored in the manifest (rank 0's copy is used):
            global step, resolved config, layout, loss scaler, data sampler position...
        rank_state: this rank's own values (RNG states...): JSON values, tuples, tensors and
            numpy arrays (see ``rank_state.py``), stored as ``rank-{rank:05d}.safetensors``
            with its sha256 in the manifest. Nothing is pickled.
        keep_last: after committing, delete all but the newest ``keep_last`` checkpoints.
        group: the ranks that save together; file names use group ranks.
        verify_writes: read every written file back and check its sha256 before committing.

    Returns:
        ``root/step-{step:08d}``, committed, on every rank.

    Communicates: two ``broadcast_object`` from rank 0 and one ``all_gather_object`` of
    per-box metadata (a few hundred bytes per box) over ``group``.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    prepared: list[ShardEntry] = []
    blob, error = b"", None
    try:
        prepared = prepare_entries(entries)
        blob = encode_rank_state(rank_state)
    except Exception as exc:  # raised on every rank by the protocol, not here alone
        error = exc
    return save_snapshot(
        root,
        step,
        prepared,
        trainer_state,
        blob,
        keep_last=keep_last,
        group=group,
        verify_writes=verify_writes,
        local_error=error,
    )

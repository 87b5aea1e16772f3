"""Reading a checkpoint: by logical tensor and flat range, whatever world size wrote it.

A checkpoint written by N ranks loads at M ranks: each new rank asks :meth:`read_range` for
its own flat ranges, and the reader assembles them from whichever stored pieces overlap.
Loading never needs a process group.
"""

from __future__ import annotations

import bisect
import logging
import pickle
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from shardwise.checkpoint import integrity
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.integrity import (
    VerifyReport,
    check_file,
    check_manifest_sha256,
    committed_manifest_sha256,
    read_manifest,
    verify,
)
from shardwise.checkpoint.journal import Journal
from shardwise.checkpoint.layout import parse_step_dir, step_dir_name
from shardwise.checkpoint.locate import resolve
from shardwise.checkpoint.manifest import Manifest, TensorRecord
from shardwise.checkpoint.shardfile import dtype_from_name

log = logging.getLogger("shardwise.checkpoint")

__all__ = ["CheckpointReader", "VerifyReport", "find_latest_valid", "resolve", "verify"]


class CheckpointReader:
    """Random access to one committed checkpoint.

    Args:
        path: a ``step-N`` directory, or a checkpoint root (its latest committed step).
        verify: check every file's sha256 first (reads the whole checkpoint once). Without it
            the journal commit and the manifest are still checked, and each rank-state file's
            checksum before it is unpickled.

    Rank-state files are unpickled: only open checkpoints from a source you trust.
    """

    def __init__(self, path: Path | str, verify: bool = True) -> None:
        self.path = Path(path) if parse_step_dir(path) is not None else resolve(path)
        self.report: VerifyReport | None = None
        if verify:
            self.report = integrity.verify(self.path)
        recorded = committed_manifest_sha256(self.path)
        self._manifest, sha = read_manifest(self.path)
        check_manifest_sha256(self.path, sha, recorded)
        self._handles: dict[str, Any] = {}
        self._starts = {
            name: [p.start for p in t.pieces] for name, t in self._manifest.tensors.items()
        }

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def step(self) -> int:
        return self._manifest.step

    @property
    def world_size(self) -> int:
        """Number of ranks that wrote the checkpoint."""
        return self._manifest.world_size

    @property
    def trainer_state(self) -> dict[str, Any]:
        return self._manifest.trainer_state

    def rank_state(self, rank: int) -> Any:
        """Unpickle the opaque state saved by ``rank`` (after checking its sha256)."""
        files = self._manifest.rank_state_files
        if not 0 <= rank < len(files):
            raise ValueError(
                f"rank must be in [0, {len(files)}) (the world size that wrote "
                f"this checkpoint), got {rank}"
            )
        record = self._manifest.files[files[rank]]
        path = self.path / record.name
        check_file(path, record.size, record.sha256)
        return pickle.loads(path.read_bytes())

    def names(self) -> list[str]:
        """Every logical tensor name, sorted."""
        return sorted(self._manifest.tensors)

    def _record(self, name: str) -> TensorRecord:
        if name not in self._manifest.tensors:
            raise KeyError(f"no tensor {name!r} in {self.path}; see names()")
        return self._manifest.tensors[name]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self._record(name).full_shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the tensor was stored in."""
        return dtype_from_name(self._record(name).dtype)

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = self.path / file
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open shard file: {exc}", path) from exc
        return self._handles[file]

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of tensor ``name`` (row-major), as a 1-D tensor.

        Assembled from every stored piece that overlaps the range, whoever wrote it.
        """
        record = self._record(name)
        if not 0 <= start <= stop <= record.numel:
            raise ValueError(
                f"range [{start}, {stop}) of {name!r} must satisfy "
                f"0 <= start <= stop <= {record.numel} (its numel)"
            )
        out = torch.empty(stop - start, dtype=dtype_from_name(record.dtype))
        first = max(0, bisect.bisect_right(self._starts[name], start) - 1)
        for piece in record.pieces[first:]:
            if piece.start >= stop:
                break
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo >= hi:
                continue
            part = self._handle(piece.file).get_slice(piece.key)[
                lo - piece.start : hi - piece.start
            ]
            if part.numel() != hi - lo:
                raise CheckpointError(
                    f"piece {piece.key!r} is shorter than the manifest says", self.path / piece.file
                )
            out[lo - start : hi - start] = part
        return out

    def read_full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` in its full shape and stored dtype."""
        record = self._record(name)
        return self.read_range(name, 0, record.numel).reshape(record.full_shape)

    def close(self) -> None:
        """Release the open shard files."""
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


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

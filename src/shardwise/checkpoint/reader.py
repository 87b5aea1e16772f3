"""Reading a checkpoint: any box of any logical tensor, whatever layout wrote it.

A checkpoint written by N ranks in one layout loads at M ranks in another: each new rank asks
:meth:`CheckpointReader.read_box` (or :meth:`~CheckpointReader.read_range` for a flat range,
which is a few boxes) for what it owns, and the reader assembles it from whichever stored boxes
intersect it. Loading never needs a process group and never unpickles.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from shardwise.checkpoint import integrity
from shardwise.checkpoint.entries import Box, flat_range_boxes, intersect, local_slices
from shardwise.checkpoint.files import dtype_from_name
from shardwise.checkpoint.integrity import (
    VerifyReport,
    check_file,
    check_manifest_sha256,
    committed_manifest_sha256,
    read_manifest,
)
from shardwise.checkpoint.journal import resolve
from shardwise.checkpoint.layout import CheckpointError, member
from shardwise.checkpoint.manifest import PICKLED_RANK_STATE, Manifest, Piece, TensorRecord
from shardwise.checkpoint.rank_state import decode_rank_state


class CheckpointReader:
    """Random access to one committed checkpoint.

    Args:
        path: a ``step-N`` directory, or a checkpoint root (its latest committed step).
        verify: check every file's sha256 first (reads the whole checkpoint once). Without it
            the journal commit and the manifest are still checked, and a rank-state file's
            checksum before it is decoded.
    """

    def __init__(self, path: Path | str, verify: bool = True) -> None:
        self.path = resolve(path)
        self.report: VerifyReport | None = None
        if verify:
            self.report = integrity.verify(self.path)
        recorded = committed_manifest_sha256(self.path)
        self._manifest, sha = read_manifest(self.path)
        check_manifest_sha256(self.path, sha, recorded)
        self._handles: dict[str, Any] = {}
        self._index = {name: _Index(t.pieces) for name, t in self._manifest.tensors.items()}

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
        """The state saved by ``rank`` (after checking its sha256); never unpickled.

        Raises:
            CheckpointError: a format-1 checkpoint (its rank states are pickles, which are not
                loaded: they could run code), or a damaged file.
        """
        files = self._manifest.rank_state_files
        if not 0 <= rank < len(files):
            raise ValueError(
                f"rank must be in [0, {len(files)}) (the world size that wrote "
                f"this checkpoint), got {rank}"
            )
        record = self._manifest.files[files[rank]]
        if record.kind == PICKLED_RANK_STATE:
            raise CheckpointError(
                f"format_version {self._manifest.format_version} stores rank states as "
                f"pickles, which are never loaded (unpickling can run code); only its tensors "
                f"and trainer state are read",
                self.path / record.name,
            )
        path = check_file(self.path, record.name, record.size, record.sha256)
        try:
            return decode_rank_state(path.read_bytes())
        except ValueError as exc:
            raise CheckpointError(str(exc), path) from exc

    def names(self) -> list[str]:
        """Every logical tensor name, sorted."""
        return sorted(self._manifest.tensors)

    def _record(self, name: str) -> TensorRecord:
        if name not in self._manifest.tensors:
            raise KeyError(f"no tensor {name!r} in {self.path}; see names()")
        return self._manifest.tensors[name]

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self._record(name).global_shape

    full_shape = global_shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the tensor was stored in."""
        return dtype_from_name(self._record(name).dtype)

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = member(self.path, file)
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open shard file: {exc}", path) from exc
        return self._handles[file]

    def _piece_part(self, piece: Piece, part: Box) -> torch.Tensor:
        """The values of box ``part`` (inside ``piece``) from the piece's stored tensor."""
        handle = self._handle(piece.file)
        if not piece.shape:  # a scalar tensor
            values = handle.get_tensor(piece.key).reshape(())
        elif piece.flat_start is None:
            values = handle.get_slice(piece.key)[local_slices(part, piece.box)]
        else:  # format 1: the piece is a run of a stored 1-D tensor
            lo = piece.flat_start
            run = handle.get_slice(piece.key)[lo : lo + math.prod(piece.shape)]
            values = (
                run.reshape(piece.shape)[local_slices(part, piece.box)]
                if run.numel() == (math.prod(piece.shape))
                else run
            )
        if tuple(values.shape) != tuple(part[1]):
            raise CheckpointError(
                f"box {piece.key!r} is smaller than the manifest says", self.path / piece.file
            )
        return values

    def read_box(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box of tensor ``name`` at ``offsets`` with ``shape``, in its stored dtype,
        assembled from every stored box that intersects it, whoever wrote it."""
        record = self._record(name)
        want: Box = (tuple(offsets), tuple(shape))
        if (
            len(offsets) != len(record.global_shape)
            or len(shape) != len(offsets)
            or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, shape, record.global_shape)
            )
        ):
            raise ValueError(
                f"box at {tuple(offsets)} of shape {tuple(shape)} must lie within {name!r}'s "
                f"global shape {record.global_shape}"
            )
        out = torch.empty(shape, dtype=dtype_from_name(record.dtype))
        if out.numel() == 0:
            return out
        for piece in self._index[name].candidates(want):
            part = intersect(want, piece.box)
            if part is not None:
                out[local_slices(part, want)] = self._piece_part(piece, part)
        return out

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of tensor ``name`` (row-major), as a 1-D tensor."""
        record = self._record(name)
        if not 0 <= start <= stop <= record.numel:
            raise ValueError(
                f"range [{start}, {stop}) of {name!r} must satisfy "
                f"0 <= start <= stop <= {record.numel} (its numel)"
            )
        out = torch.empty(stop - start, dtype=dtype_from_name(record.dtype))
        for (offsets, shape), lo in flat_range_boxes(record.global_shape, start, stop):
            n = math.prod(shape)
            out[lo - start : lo - start + n] = self.read_box(name, offsets, shape).reshape(-1)
        return out

    def read_full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` in its global shape and stored dtype."""
        shape = self._record(name).global_shape
        return self.read_box(name, (0,) * len(shape), shape)

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


class _Index:
    """A tensor's pieces sorted by their offset on dim 0, to find those a box may touch."""

    def __init__(self, pieces: tuple[Piece, ...]) -> None:
        self.pieces = sorted(pieces, key=lambda p: p.offsets[:1])
        self.starts = [p.offsets[0] if p.offsets else 0 for p in self.pieces]
        self.longest = max((p.shape[0] if p.shape else 1 for p in self.pieces), default=0)

    def candidates(self, box: Box) -> list[Piece]:
        if not box[0]:
            return self.pieces
        lo, hi = box[0][0], box[0][0] + box[1][0]
        first = bisect.bisect_left(self.starts, lo - self.longest + 1)
        last = bisect.bisect_left(self.starts, hi)
        return self.pieces[first:last]

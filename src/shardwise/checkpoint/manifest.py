"""The manifest: one JSON file per checkpoint saying which box of which tensor lives where.

``manifest.json`` (format_version 2)::

    {
      "format_version": 2,
      "step": 100,
      "world_size": 2,
      "tensors": [
        {"name": "model/w", "global_shape": [4, 3], "dtype": "float32",
         "pieces": [{"file": "shard-00000-of-00002.safetensors", "key": "model/w@0,0",
                     "offsets": [0, 0], "shape": [2, 3]}, ...]},
        ...                                                        # sorted by name
      ],
      "files": {"shard-00000-of-00002.safetensors":
                  {"rank": 0, "kind": "shard", "size": 1234, "sha256": "..."},
                "rank-00000.safetensors": {"rank": 0, "kind": "rank_state", ...}, ...},
      "rank_state_files": ["rank-00000.safetensors", ...],        # index = rank
      "trainer_state": {...}                                       # the caller's JSON object
    }

The pieces of every tensor cover it exactly once; :func:`build_manifest` refuses anything
else, and :func:`parse_manifest` re-checks it when reading, along with every file name (plain
names inside the step directory only).

Format 1 (read only) stored flat ranges ``{"start", "numel"}`` of the row-major tensor under
``"full_shape"``, each as a 1-D tensor, and pickled rank states (``rank-NNNNN.pkl``): its
pieces are read as the boxes of each range (``Piece.flat_start``), and its rank states are
never unpickled (``FileRecord.kind == "rank_state_pickle"``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.checkpoint.entries import Box, coverage_problem, flat_range_boxes
from shardwise.checkpoint.files import dtype_from_name
from shardwise.checkpoint.layout import (
    FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    CheckpointError,
    check_plain_name,
)

FILE_KINDS = ("shard", "rank_state")
PICKLED_RANK_STATE = "rank_state_pickle"
"""The kind given to a format-1 rank state: listed and checksummed, never loaded."""


@dataclass(frozen=True)
class Piece:
    """A box of a tensor, stored in ``file`` under ``key``.

    ``flat_start`` is None when the stored tensor has the box's shape (format 2); in format 1
    the stored tensor is 1-D and the box is its elements from ``flat_start`` on.
    """

    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat_start: int | None = None

    @property
    def box(self) -> Box:
        return self.offsets, self.shape


@dataclass(frozen=True)
class TensorRecord:
    """A logical tensor: its global shape, stored dtype, and the pieces that hold it."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)


@dataclass(frozen=True)
class FileRecord:
    """A file of the checkpoint, written by ``rank``, with its size and sha256."""

    name: str
    rank: int
    kind: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PieceMeta:
    """What a rank reports about one of its boxes in the metadata gather."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    key: str


@dataclass(frozen=True)
class RankMeta:
    """One rank's contribution to the manifest, sent to rank 0 by ``all_gather_object``."""

    rank: int
    pieces: tuple[PieceMeta, ...]
    files: tuple[FileRecord, ...]
    rank_state_file: str


@dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json``."""

    format_version: int
    step: int
    world_size: int
    tensors: dict[str, TensorRecord]
    files: dict[str, FileRecord]
    rank_state_files: tuple[str, ...]
    trainer_state: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        assert self.format_version == FORMAT_VERSION, "only the current format is written"
        doc = {
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "tensors": [
                {
                    "name": t.name,
                    "global_shape": list(t.global_shape),
                    "dtype": t.dtype,
                    "pieces": [
                        {
                            "file": p.file,
                            "key": p.key,
                            "offsets": list(p.offsets),
                            "shape": list(p.shape),
                        }
                        for p in t.pieces
                    ],
                }
                for t in sorted(self.tensors.values(), key=lambda t: t.name)
            ],
            "files": {
                f.name: {"rank": f.rank, "kind": f.kind, "size": f.size, "sha256": f.sha256}
                for f in self.files.values()
            },
            "rank_state_files": list(self.rank_state_files),
            "trainer_state": self.trainer_state,
        }
        return (json.dumps(doc, indent=1) + "\n").encode()


def build_manifest(step: int, ranks: list[RankMeta], trainer_state: dict[str, Any]) -> Manifest:
    """Join every rank's metadata into a manifest after checking coverage.

    Raises:
        ValueError: two ranks disagree on a tensor's global shape or dtype, or a tensor's boxes
            leave a gap or overlap (the message names the tensor, the ranks and the elements).
    """
    by_name: dict[str, list[tuple[int, PieceMeta]]] = {}
    for meta in ranks:
        for p in meta.pieces:
            by_name.setdefault(p.name, []).append((meta.rank, p))
    tensors: dict[str, TensorRecord] = {}
    for name, owned in by_name.items():
        r0, first = owned[0]
        for r, p in owned:
            if p.global_shape != first.global_shape or p.dtype != first.dtype:
                raise ValueError(
                    f"tensor {name!r}: rank {r0} gives global shape {first.global_shape} dtype "
                    f"{first.dtype} but rank {r} gives {p.global_shape} {p.dtype}; every rank "
                    f"must describe the same full tensor"
                )
        kept = [(r, p) for r, p in owned if math.prod(p.shape) > 0]
        boxes = [((p.offsets, p.shape), f"rank {r} box {p.offsets}+{p.shape}") for r, p in kept]
        problem = coverage_problem(name, first.global_shape, boxes)
        if problem:
            raise ValueError(problem)
        pieces = tuple(
            sorted(
                (Piece(p.file, p.key, p.offsets, p.shape) for _, p in kept), key=lambda q: q.offsets
            )
        )
        tensors[name] = TensorRecord(name, first.global_shape, first.dtype, pieces)
    files = {f.name: f for meta in ranks for f in meta.files}
    order = sorted(ranks, key=lambda m: m.rank)
    return Manifest(
        FORMAT_VERSION,
        step,
        len(ranks),
        tensors,
        files,
        tuple(m.rank_state_file for m in order),
        trainer_state,
    )


def _get(doc: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(doc, dict):
        raise ValueError(f"{where} is not a JSON object")
    if key not in doc:
        raise ValueError(f"{where} has no {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{where}: {key!r} has type {type(value).__name__}")
    return value


def _ints(values: Any, where: str) -> tuple[int, ...]:
    if not isinstance(values, list) or any(
        not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values
    ):
        raise ValueError(f"{where}: expected a list of ints >= 0, got {values!r}")
    return tuple(values)


def _pieces_v2(doc: Any, where: str) -> list[Piece]:
    pieces = []
    for p in _get(doc, "pieces", list, where):
        offsets = _ints(_get(p, "offsets", list, where), where)
        shape = _ints(_get(p, "shape", list, where), where)
        pieces.append(
            Piece(_get(p, "file", str, where), _get(p, "key", str, where), offsets, shape)
        )
    return pieces


def _pieces_v1(doc: Any, shape: tuple[int, ...], where: str) -> list[Piece]:
    pieces = []
    for p in _get(doc, "pieces", list, where):
        file, key = _get(p, "file", str, where), _get(p, "key", str, where)
        start, numel = _get(p, "start", int, where), _get(p, "numel", int, where)
        if start < 0 or numel < 0 or start + numel > math.prod(shape):
            raise ValueError(f"{where}: piece {key!r} lies outside the tensor")
        for (offsets, size), lo in flat_range_boxes(shape, start, start + numel):
            pieces.append(Piece(file, key, offsets, size, lo - start))
    return pieces


def _parse_tensor(doc: Any, files: dict[str, FileRecord], version: int) -> TensorRecord:
    name = _get(doc, "name", str, "a tensor")
    where = f"tensor {name!r}"
    shape_key = "global_shape" if version >= 2 else "full_shape"
    shape = _ints(_get(doc, shape_key, list, where), where)
    dtype = _get(doc, "dtype", str, where)
    dtype_from_name(dtype)
    pieces = _pieces_v2(doc, where) if version >= 2 else _pieces_v1(doc, shape, where)
    for piece in pieces:
        if files.get(piece.file) is None or files[piece.file].kind != "shard":
            raise ValueError(f"{where}: piece refers to {piece.file!r}, not a listed shard file")
    pieces.sort(key=lambda q: q.offsets)
    problem = coverage_problem(name, shape, [(q.box, f"piece {q.key!r}") for q in pieces])
    if problem:
        raise ValueError(problem)
    return TensorRecord(name, shape, dtype, tuple(pieces))


def _parse_files(doc: dict[str, Any], version: int) -> dict[str, FileRecord]:
    files = {}
    for name, f in _get(doc, "files", dict, "manifest").items():
        check_plain_name(name, "manifest 'files'")
        kind = _get(f, "kind", str, f"file {name!r}")
        if kind not in FILE_KINDS:
            raise ValueError(f"file {name!r} has unknown kind {kind!r}")
        if version == 1 and kind == "rank_state":
            kind = PICKLED_RANK_STATE
        files[name] = FileRecord(
            name,
            _get(f, "rank", int, name),
            kind,
            _get(f, "size", int, name),
            _get(f, "sha256", str, name),
        )
    return files


def _version(doc: Any, path: Path) -> int:
    if not isinstance(doc, dict) or "format_version" not in doc:
        raise CheckpointError("manifest is malformed: no 'format_version'", path)
    version = doc["format_version"]
    if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"unknown format_version {version!r}; this shardwise reads format_version "
            f"{', '.join(str(v) for v in READABLE_FORMAT_VERSIONS)} and writes "
            f"{FORMAT_VERSION} (a newer shardwise wrote it: upgrade shardwise)",
            path,
        )
    return int(version)


def parse_manifest(data: bytes, path: Path) -> Manifest:
    """Parse and check the bytes of ``manifest.json`` read from ``path`` (format 1 or 2).

    Raises:
        CheckpointError naming ``path``: truncated or invalid JSON, an unknown format_version,
            or a malformed structure (missing keys, boxes that do not cover a tensor, a file
            name that is not a plain name inside the checkpoint directory).
    """
    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"manifest is truncated or not valid JSON ({exc})", path) from exc
    version = _version(doc, path)
    try:
        files = _parse_files(doc, version)
        tensors = {}
        for t in _get(doc, "tensors", list, "manifest"):
            record = _parse_tensor(t, files, version)
            tensors[record.name] = record
        world = _get(doc, "world_size", int, "manifest")
        rank_files = tuple(_get(doc, "rank_state_files", list, "manifest"))
        for name in rank_files:
            check_plain_name(name, "manifest 'rank_state_files'")
        if len(rank_files) != world or any(
            files.get(f) is None or files[f].kind not in ("rank_state", PICKLED_RANK_STATE)
            for f in rank_files
        ):
            raise ValueError("'rank_state_files' must name one listed rank-state file per rank")
        return Manifest(
            version,
            _get(doc, "step", int, "manifest"),
            world,
            tensors,
            files,
            rank_files,
            _get(doc, "trainer_state", dict, "manifest"),
        )
    except (ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"manifest is malformed: {exc}", path) from exc

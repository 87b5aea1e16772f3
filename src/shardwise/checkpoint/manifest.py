"""The manifest: one JSON file per checkpoint saying which bytes of which tensor live where.

``manifest.json`` (format_version 1)::

    {
      "format_version": 1,
      "step": 100,
      "world_size": 2,
      "tensors": [
        {"name": "model/w", "full_shape": [4, 3], "dtype": "float32",
         "pieces": [{"file": "shard-00000-of-00002.safetensors", "key": "model/w@0",
                     "start": 0, "numel": 7}, ...]},              # sorted by start
        ...                                                        # sorted by name
      ],
      "files": {"shard-00000-of-00002.safetensors":
                  {"rank": 0, "kind": "shard", "size": 1234, "sha256": "..."},
                "rank-00000.pkl": {"rank": 0, "kind": "rank_state", ...}, ...},
      "rank_state_files": ["rank-00000.pkl", "rank-00001.pkl"],     # index = rank
      "trainer_state": {...}                                       # the caller's JSON object
    }

The pieces of every tensor cover ``[0, numel)`` exactly once; :func:`build_manifest` refuses
anything else, and :func:`parse_manifest` re-checks it when reading.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.layout import FORMAT_VERSION
from shardwise.checkpoint.shardfile import dtype_from_name

FILE_KINDS = ("shard", "rank_state")


@dataclass(frozen=True)
class Piece:
    """A contiguous flat range ``[start, start + numel)`` of a tensor, stored under ``key``."""

    file: str
    key: str
    start: int
    numel: int

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class TensorRecord:
    """A logical tensor: its full shape, stored dtype, and the pieces that hold it."""

    name: str
    full_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)


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
    """What a rank reports about one of its pieces in the metadata gather."""

    name: str
    full_shape: tuple[int, ...]
    dtype: str
    start: int
    numel: int
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
        doc = {
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "tensors": [
                {
                    "name": t.name,
                    "full_shape": list(t.full_shape),
                    "dtype": t.dtype,
                    "pieces": [
                        {"file": p.file, "key": p.key, "start": p.start, "numel": p.numel}
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
        return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()


def _coverage_problem(name: str, numel: int, spans: list[tuple[int, int, str]]) -> str | None:
    """Say what is wrong with ``spans`` (start, stop, owner) covering ``[0, numel)``, if any."""
    covered, last_owner = 0, ""
    for start, stop, owner in sorted(spans):
        if start < covered:
            return (
                f"tensor {name!r}: {owner} starts at element {start} but {last_owner} "
                f"already covers up to {covered} (overlap)"
            )
        if start > covered:
            return f"tensor {name!r}: elements [{covered}, {start}) are held by no rank (gap)"
        covered, last_owner = stop, owner
    if covered != numel:
        return (
            f"tensor {name!r}: elements [{covered}, {numel}) are held by no rank (gap); "
            f"the pieces of all ranks must cover prod(full_shape) = {numel} exactly once"
        )
    return None


def build_manifest(step: int, ranks: list[RankMeta], trainer_state: dict[str, Any]) -> Manifest:
    """Join every rank's metadata into a manifest after checking coverage.

    Raises:
        ValueError: two ranks disagree on a tensor's full_shape or dtype, or a tensor's pieces
            leave a gap or overlap (the message names the tensor, the ranks and the range).
    """
    by_name: dict[str, list[tuple[int, PieceMeta]]] = {}
    for meta in ranks:
        for p in meta.pieces:
            by_name.setdefault(p.name, []).append((meta.rank, p))
    tensors: dict[str, TensorRecord] = {}
    for name, owned in by_name.items():
        r0, first = owned[0]
        for r, p in owned:
            if p.full_shape != first.full_shape or p.dtype != first.dtype:
                raise ValueError(
                    f"tensor {name!r}: rank {r0} gives full_shape {first.full_shape} dtype "
                    f"{first.dtype} but rank {r} gives {p.full_shape} {p.dtype}; every rank "
                    f"must describe the same full tensor"
                )
        numel = math.prod(first.full_shape)
        spans = [
            (p.start, p.start + p.numel, f"rank {r} [{p.start}, {p.start + p.numel})")
            for r, p in owned
            if p.numel > 0
        ]
        problem = _coverage_problem(name, numel, spans)
        if problem:
            raise ValueError(problem)
        pieces = tuple(
            sorted(
                (Piece(p.file, p.key, p.start, p.numel) for _, p in owned if p.numel > 0),
                key=lambda q: q.start,
            )
        )
        tensors[name] = TensorRecord(name, first.full_shape, first.dtype, pieces)
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


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise ValueError(f"{where} has no {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{where}: {key!r} has type {type(value).__name__}")
    return value


def _parse_tensor(doc: Any, files: dict[str, FileRecord]) -> TensorRecord:
    if not isinstance(doc, dict):
        raise ValueError("an entry of 'tensors' is not an object")
    name = _get(doc, "name", str, "a tensor")
    where = f"tensor {name!r}"
    shape = tuple(int(d) for d in _get(doc, "full_shape", list, where))
    dtype = _get(doc, "dtype", str, where)
    dtype_from_name(dtype)
    pieces = []
    for p in _get(doc, "pieces", list, where):
        piece = Piece(
            _get(p, "file", str, where),
            _get(p, "key", str, where),
            _get(p, "start", int, where),
            _get(p, "numel", int, where),
        )
        if piece.file not in files:
            raise ValueError(f"{where}: piece refers to {piece.file!r}, not listed in 'files'")
        pieces.append(piece)
    pieces.sort(key=lambda q: q.start)
    record = TensorRecord(name, shape, dtype, tuple(pieces))
    problem = _coverage_problem(
        name, record.numel, [(q.start, q.stop, f"piece {q.key!r}") for q in pieces]
    )
    if problem:
        raise ValueError(problem)
    return record


def parse_manifest(data: bytes, path: Path) -> Manifest:
    """Parse and check the bytes of ``manifest.json`` read from ``path``.

    Raises:
        CheckpointError naming ``path``: truncated or invalid JSON, an unknown format_version,
            or a malformed structure (missing keys, pieces that do not cover a tensor).
    """
    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"manifest is truncated or not valid JSON ({exc})", path) from exc
    if not isinstance(doc, dict) or "format_version" not in doc:
        raise CheckpointError("manifest is malformed: no 'format_version'", path)
    version = doc["format_version"]
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"unknown format_version {version!r}; this shardwise reads "
            f"format_version {FORMAT_VERSION} (upgrade shardwise)",
            path,
        )
    try:
        files = {}
        for name, f in _get(doc, "files", dict, "manifest").items():
            kind = _get(f, "kind", str, f"file {name!r}")
            if kind not in FILE_KINDS:
                raise ValueError(f"file {name!r} has unknown kind {kind!r}")
            files[name] = FileRecord(
                name,
                _get(f, "rank", int, name),
                kind,
                _get(f, "size", int, name),
                _get(f, "sha256", str, name),
            )
        tensors = {}
        for t in _get(doc, "tensors", list, "manifest"):
            record = _parse_tensor(t, files)
            tensors[record.name] = record
        world = _get(doc, "world_size", int, "manifest")
        rank_files = tuple(_get(doc, "rank_state_files", list, "manifest"))
        if len(rank_files) != world or any(f not in files for f in rank_files):
            raise ValueError("'rank_state_files' must name one listed file per rank")
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

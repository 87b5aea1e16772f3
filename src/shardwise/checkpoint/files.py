"""Bytes on disk that survive a crash: fsync, checksums, and safetensors files.

Shard files are written as a stream (instead of ``safetensors.torch.save``): no second in-memory
copy of the shard, the bytes are hashed as they go out, and the ``mid_file`` test hook can stop
half-way through. Layout (safetensors spec): 8-byte little-endian header length, a JSON header
``{key: {"dtype", "shape", "data_offsets"}}`` padded with spaces to a multiple of 8, then the
tensors' bytes back to back in header order. :func:`save_safetensors` is the one way a whole
tensor dict is written to a file (exports, final model weights): temp name, fsync, rename.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import torch
from safetensors.torch import save as safetensors_bytes

READ_CHUNK_BYTES = 8 << 20
WRITE_CHUNK_BYTES = 16 << 20

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

_BY_NAME = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling stored in the manifest)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for a dtype the format does not store."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> tuple[int, str]:
    """``(size_bytes, sha256 hex)`` of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def write_bytes_durably(path: Path, data: bytes) -> str:
    """Write ``data`` to ``path`` (replacing it), flush and fsync; return its sha256 hex.

    The directory entry is not fsynced here: callers fsync the directory once for many files.
    """
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: ``<path>.tmp``, fsync, rename.

    A failure removes the temp file and leaves ``path`` as it was. The directory is not fsynced
    here: callers fsync it once for many files (:func:`fsync_dir`).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_bytes_durably(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_safetensors(
    path: Path | str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` as one safetensors file at ``path``, atomically and durably.

    The bytes go to ``<path>.tmp``, are fsynced and renamed over ``path``; the directory is
    fsynced. A failure removes the temp file. ``path`` must not be a directory.
    """
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{out} is a directory; give a file name, e.g. {out}/model.safetensors")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} does not exist; create it or write elsewhere")
    data = safetensors_bytes(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
        metadata={"format": "pt", **(metadata or {})},
    )
    write_atomically(out, data)
    fsync_dir(out.parent.resolve())


class _HashingSink:
    """A file writer that hashes what it writes and can call ``trip`` once at byte ``trip_at``."""

    def __init__(self, f: IO[bytes], trip_at: int | None, trip: Callable[[], None] | None) -> None:
        self.f, self.trip_at, self.trip = f, trip_at, trip
        self.digest = hashlib.sha256()
        self.written = 0

    def write(self, buf: memoryview) -> None:
        if (
            self.trip_at is not None
            and self.trip is not None
            and self.written + len(buf) > self.trip_at
        ):
            head = self.trip_at - self.written
            self._write(buf[:head])
            self.f.flush()
            self.trip_at = None
            self.trip()
            buf = buf[head:]
        self._write(buf)

    def _write(self, buf: memoryview) -> None:
        self.f.write(buf)
        self.digest.update(buf)
        self.written += len(buf)


def safetensors_header(
    specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: dict[str, str] | None = None,
) -> bytes:
    """The header bytes (length prefix included) of a safetensors file holding tensors
    ``(key, dtype, shape)`` back to back in this order; ``metadata`` joins ``format: pt``."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for key, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def tensor_chunks(t: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of contiguous CPU tensor ``t`` in row-major order, in chunks, without a copy."""
    if t.numel() == 0:
        return
    data = t.reshape(-1).view(torch.uint8).numpy().data  # zero-copy bytes of t
    for lo in range(0, len(data), WRITE_CHUNK_BYTES):
        yield data[lo : lo + WRITE_CHUNK_BYTES]


def write_shard_file(
    path: Path, pieces: list[tuple[str, torch.Tensor]], midway: Callable[[], None] | None = None
) -> tuple[int, str]:
    """Write ``pieces`` (key, contiguous CPU tensor of any shape) to ``path``, fsync it.

    Args:
        path: the file to create (replaced if present).
        pieces: keys must be unique.
        midway: called once after about half the file's bytes are written (test hook).

    Returns:
        ``(size_bytes, sha256 hex)`` of the bytes written.
    """
    head = safetensors_header([(key, t.dtype, t.shape) for key, t in pieces])
    total = len(head) + sum(t.numel() * t.element_size() for _, t in pieces)
    with open(path, "wb") as f:
        sink = _HashingSink(f, total // 2 if midway else None, midway)
        sink.write(memoryview(head))
        for _, t in pieces:
            for chunk in tensor_chunks(t):
                sink.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    assert sink.written == total, (sink.written, total)
    return total, sink.digest.hexdigest()


def read_safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of the bytes of a safetensors file; ValueError if they are not one."""
    if len(data) < 8:
        raise ValueError("too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"safetensors header length {n} exceeds the file")
    header = json.loads(data[8 : 8 + n].decode())
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}

"""One rank's shard file, in the safetensors format, written as a stream.

Streaming (instead of ``safetensors.torch.save``) avoids a second in-memory copy of the shard,
hashes the bytes as they go out, and lets the ``mid_file`` test hook stop half-way through.
Layout (safetensors spec): 8-byte little-endian header length, a JSON header
``{key: {"dtype", "shape", "data_offsets"}}`` padded with spaces to a multiple of 8, then the
tensors' bytes back to back in header order.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

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


class _HashingSink:
    """A file writer that hashes what it writes and can call ``trip`` once at byte ``trip_at``."""

    def __init__(self, f: object, trip_at: int | None, trip: Callable[[], None] | None) -> None:
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
            self.f.flush()  # type: ignore[attr-defined]
            self.trip_at = None
            self.trip()
            buf = buf[head:]
        self._write(buf)

    def _write(self, buf: memoryview) -> None:
        self.f.write(buf)  # type: ignore[attr-defined]
        self.digest.update(buf)
        self.written += len(buf)


def _header(pieces: list[tuple[str, torch.Tensor]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in pieces:
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": [t.numel()],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard_file(
    path: Path, pieces: list[tuple[str, torch.Tensor]], midway: Callable[[], None] | None = None
) -> tuple[int, str]:
    """Write ``pieces`` (key, 1-D contiguous CPU tensor) to ``path``, fsync it.

    Args:
        path: the file to create (replaced if present).
        pieces: keys must be unique; an empty tensor is stored as shape ``[0]``.
        midway: called once after about half the file's bytes are written (test hook).

    Returns:
        ``(size_bytes, sha256 hex)`` of the bytes written.
    """
    head = _header(pieces)
    total = len(head) + sum(t.numel() * t.element_size() for _, t in pieces)
    with open(path, "wb") as f:
        sink = _HashingSink(f, total // 2 if midway else None, midway)
        sink.write(memoryview(head))
        for _, t in pieces:
            if t.numel() == 0:
                continue
            data = t.view(torch.uint8).numpy().data  # zero-copy bytes of t
            for lo in range(0, len(data), WRITE_CHUNK_BYTES):
                sink.write(data[lo : lo + WRITE_CHUNK_BYTES])
        f.flush()
        os.fsync(f.fileno())
    assert sink.written == total, (sink.written, total)
    return total, sink.digest.hexdigest()

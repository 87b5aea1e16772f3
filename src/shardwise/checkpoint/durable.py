"""Writes that survive a crash: fsync of files and directories, checksums while writing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

READ_CHUNK_BYTES = 8 << 20


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

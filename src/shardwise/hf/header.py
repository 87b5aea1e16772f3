"""The header of a safetensors file, read and checked without touching the tensors' bytes.

A safetensors file is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets relative to the end of the
header) and the tensors' bytes. Checking the header against the file size up front turns a
truncated download or a damaged copy into one error naming the file and the first tensor whose
bytes are not there, before any rank reads anything.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.checkpoint.files import SAFETENSORS_DTYPES
from shardwise.hf.errors import WeightsError

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library refuses larger headers; so do we (a garbage length is caught here)."""

STORED_DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
"""safetensors dtype code (``"BF16"``) -> torch dtype."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file."""

    file: Path
    """The file holding it."""
    dtype: torch.dtype
    """Its dtype on disk."""
    shape: tuple[int, ...]
    """Its shape."""
    begin: int
    """Byte offset of its first byte from the start of the file."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check the header of the safetensors file at ``path``.

    Checks that the header fits in the file, that every entry has a known dtype, a shape of ints
    >= 0 and data offsets whose length matches the shape and dtype, and that every tensor's bytes
    lie inside the file (a truncated file fails here, naming the first tensor cut off).

    Raises:
        WeightsError: naming ``path`` (and the tensor, where one is at fault).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{size} bytes is too short for a safetensors file", path)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise WeightsError(
                    f"header length {n} does not fit in the file ({size} bytes): truncated "
                    f"or not a safetensors file",
                    path,
                )
            raw = f.read(n)
    except OSError as exc:
        raise WeightsError(f"cannot read: {exc.strerror or exc}", path) from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"header is not valid JSON ({exc})", path) from exc
    if not isinstance(header, dict):
        raise WeightsError("header is not a JSON object", path)
    data_start = 8 + n
    out = {
        name: _entry(path, name, entry, data_start)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    for name, info in sorted(out.items(), key=lambda kv: kv[1].begin):
        if info.begin + info.nbytes > size:
            raise WeightsError(
                f"its bytes [{info.begin}, {info.begin + info.nbytes}) run past the end of the "
                f"file ({size} bytes): the file is truncated; copy or download it again",
                path,
                name,
            )
    return out


def _entry(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise WeightsError("header entry is not a JSON object", path, name)
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in STORED_DTYPES:
        allowed = ", ".join(sorted(STORED_DTYPES))
        raise WeightsError(f"dtype {code!r} cannot be read; readable dtypes: {allowed}", path, name)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WeightsError(f"shape {shape!r} is not a list of ints >= 0", path, name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise WeightsError(
            f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end", path, name
        )
    info = TensorInfo(path, STORED_DTYPES[code], tuple(shape), data_start + offsets[0])
    if offsets[1] - offsets[0] != info.nbytes:
        raise WeightsError(
            f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but shape {shape} "
            f"of {code} needs {info.nbytes}",
            path,
            name,
        )
    return info

"""Reading a rank's share of Hugging Face safetensors weights, and nothing more.

:func:`open_weights` opens a model directory (one ``model.safetensors`` or shards with an
index) or a plain ``.safetensors`` file and checks every header and the index up front. A rank
then asks for exactly what it keeps: a box (a tensor-parallel slice) with :meth:`read_box`, or a
flat element range of the row-major tensor (a ZeRO shard, which may start and end inside a row)
with :meth:`read_flat`. Both read only the requested elements with positioned reads (nothing is
memory-mapped, so a per-process data limit counts only what is read) and convert dtype per
slice, so a bf16 checkpoint fills fp32 masters without a full-size bf16 copy. ``bytes_read``
counts the bytes taken from the files, so tests can assert that a rank read its share and not
the file.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import torch

from shardwise.checkpoint.entries import flat_range_boxes
from shardwise.hf.box_read import read_box_from
from shardwise.hf.errors import WeightsError
from shardwise.hf.header import TensorInfo, read_header
from shardwise.hf.model_dir import WeightFiles, weight_files

logger = logging.getLogger(__name__)

DEFAULT_MAX_OPEN_FILES = 8
"""Open files kept at once; the least recently used is closed past this."""


_R = TypeVar("_R", bound="ClosesOnExit")


class ClosesOnExit:
    """``with`` support for a reader: :meth:`close` when the block is left."""

    def close(self) -> None:
        """Release what the reader holds open."""

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SafetensorsSource(ClosesOnExit):
    """Random access to the tensors of one or more safetensors files.

    Args:
        files: the files and, for shards, the index (from :func:`weight_files`).
        max_open_files: how many files stay open at once.

    Raises:
        WeightsError: a damaged header, a truncated file, a tensor the index puts in a file
            whose header lacks it, or a tensor stored in two of the files.
    """

    def __init__(self, files: WeightFiles, max_open_files: int = DEFAULT_MAX_OPEN_FILES) -> None:
        if max_open_files < 1:
            raise ValueError(f"max_open_files must be >= 1, got {max_open_files}")
        self.files = files
        self.max_open_files = max_open_files
        self.bytes_read = 0
        """Bytes copied out of the files so far (in their stored dtypes)."""
        self._info = _tensor_infos(files)
        self._handles: OrderedDict[Path, int] = OrderedDict()

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self._info)

    def __contains__(self, name: object) -> bool:
        return name in self._info

    def info(self, name: str) -> TensorInfo:
        """Where tensor ``name`` lies: file, stored dtype, shape."""
        if name not in self._info:
            raise KeyError(f"no tensor {name!r} in {self.origin}; see names()")
        return self._info[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the tensor is stored in."""
        return self.info(name).dtype

    @property
    def open_file_count(self) -> int:
        """Files open now; at most ``max_open_files``."""
        return len(self._handles)

    @property
    def origin(self) -> Path:
        """The index file, or the one weights file."""
        return self.files.index or self.files.files[0]

    def read_box(
        self,
        name: str,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The box of tensor ``name`` at ``offsets`` with ``shape``, converted to ``dtype``
        (None: the stored dtype). Only the box's elements are read from the file."""
        info = self.info(name)
        _check_box(info, name, tuple(offsets), tuple(shape))
        target = dtype or info.dtype
        check_conversion(info.dtype, target, info.file, name)
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=target)
        values = read_box_from(self._handle(info.file), info, name, tuple(offsets), tuple(shape))
        self.bytes_read += values.numel() * values.element_size()
        return values.to(target)

    def read_flat(
        self, name: str, start: int, stop: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of row-major tensor ``name`` as a 1-D tensor of
        ``dtype`` (None: stored). A range that starts or ends inside a row is read as at most
        ``2 * ndim - 1`` boxes (partial rows, whole rows), so exactly its elements are read."""
        info = self.info(name)
        if not 0 <= start <= stop <= info.numel:
            raise WeightsError(
                f"flat range [{start}, {stop}) must satisfy 0 <= start <= stop <= "
                f"{info.numel} (its numel)",
                info.file,
                name,
            )
        target = dtype or info.dtype
        check_conversion(info.dtype, target, info.file, name)
        out = torch.empty(stop - start, dtype=target)
        for (offsets, shape), lo in flat_range_boxes(info.shape, start, stop):
            n = math.prod(shape)
            out[lo - start : lo - start + n] = self.read_box(name, offsets, shape, target).reshape(
                -1
            )
        return out

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name``, converted to ``dtype`` (None: stored)."""
        shape = self.shape(name)
        return self.read_box(name, (0,) * len(shape), shape, dtype)

    def _handle(self, file: Path) -> int:
        if file in self._handles:
            self._handles.move_to_end(file)
            return self._handles[file]
        while len(self._handles) >= self.max_open_files:
            os.close(self._handles.popitem(last=False)[1])
        try:
            handle = os.open(file, os.O_RDONLY)
        except OSError as exc:
            raise WeightsError(f"cannot open: {exc.strerror or exc}", file) from exc
        self._handles[file] = handle
        return handle

    def close(self) -> None:
        """Release the open files."""
        while self._handles:
            os.close(self._handles.popitem()[1])


def open_weights(
    path: Path | str, max_open_files: int = DEFAULT_MAX_OPEN_FILES
) -> SafetensorsSource:
    """Open the weights of a Hugging Face model directory or of one ``.safetensors`` file.

    Every header (and the index) is read and checked now; tensors are read on demand.

    Raises:
        WeightsError: naming the file (and tensor) at fault; see :func:`weight_files` and
            :class:`SafetensorsSource`.
    """
    return SafetensorsSource(weight_files(path), max_open_files)


def _tensor_infos(files: WeightFiles) -> dict[str, TensorInfo]:
    """Every tensor of the source, checked against the index: each indexed name is in its
    file's header, and no name is stored in two files."""
    headers = {f: read_header(f) for f in files.files}
    holder: dict[str, Path] = {}
    for file, header in headers.items():
        for name in header:
            if name in holder:
                raise WeightsError(
                    f"is stored in both {holder[name].name} and {file.name}; a tensor must be "
                    f"stored once",
                    file,
                    name,
                )
            holder[name] = file
    if files.weight_map is None:
        return dict(headers[files.files[0]])
    out: dict[str, TensorInfo] = {}
    for name, file in files.weight_map.items():
        if name not in headers[file]:
            where = f" (it is in {holder[name].name})" if name in holder else ""
            raise WeightsError(
                f"the index puts it in {file.name}, whose header does not hold it{where}",
                file,
                name,
            )
        out[name] = headers[file][name]
    extra = sorted(set(holder) - set(out))
    if extra:
        logger.info(
            "%s: %d tensors in the shards are not in the index (ignored)", files.index, len(extra)
        )
    return out


def _check_box(
    info: TensorInfo, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    if (
        len(offsets) != len(info.shape)
        or len(shape) != len(offsets)
        or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, shape, info.shape))
    ):
        raise WeightsError(
            f"box at {offsets} of shape {shape} must lie within its shape {info.shape}",
            info.file,
            name,
        )


def check_conversion(stored: torch.dtype, dtype: torch.dtype, path: Path, name: str) -> None:
    """WeightsError unless values stored as ``stored`` keep their meaning as ``dtype``."""
    if stored.is_floating_point != dtype.is_floating_point:
        raise WeightsError(
            f"is stored as {stored} and cannot be read as {dtype}: only float <-> float "
            f"and int <-> int conversions keep the values",
            path,
            name,
        )

"""A shardwise checkpoint seen as a weights source, like a Hugging Face directory.

:class:`~shardwise.checkpoint.CheckpointReader` already reads any box of any layout from the
stored boxes that intersect it; this puts the model's tensors (``model/<name>`` and
``buffer/<name>``) behind the same calls as :class:`~shardwise.hf.source.SafetensorsSource`
(``names``, ``shape``, ``dtype``, ``read_box`` / ``read_flat`` with a per-slice dtype,
``bytes_read``), so one loading path serves both, and :func:`~shardwise.hf.names.map_names`
works on it unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.tools import BUFFER_PREFIX, MODEL_PREFIX
from shardwise.hf.source import ClosesOnExit, check_conversion


class CheckpointWeights(ClosesOnExit):
    """The model tensors of a committed checkpoint (``step-N`` directory or a root: its latest).

    Args:
        path: the checkpoint.
        verify: check every file's sha256 first (reads the whole checkpoint once).
    """

    def __init__(self, path: Path | str, verify: bool = False) -> None:
        self.reader = CheckpointReader(path, verify=verify)
        self.bytes_read = 0
        """Bytes of the boxes returned so far (in their stored dtypes)."""
        self._keys = {
            n.split("/", 1)[1]: n
            for n in self.reader.names()
            if n.startswith((MODEL_PREFIX, BUFFER_PREFIX))
        }

    @property
    def origin(self) -> Path:
        return self.reader.path

    def names(self) -> list[str]:
        """The model's tensor names, sorted."""
        return sorted(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def _key(self, name: str) -> str:
        if name not in self._keys:
            raise KeyError(f"no model tensor {name!r} in {self.origin}; see names()")
        return self._keys[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.global_shape(self._key(name))

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the tensor is stored in."""
        return self.reader.dtype(self._key(name))

    def read_box(
        self,
        name: str,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The box of ``name`` at ``offsets`` with ``shape``, converted to ``dtype``."""
        self._check_conversion(name, dtype)
        values = self.reader.read_box(self._key(name), offsets, shape)
        self.bytes_read += values.numel() * values.element_size()
        return values if dtype is None else values.to(dtype)

    def read_flat(
        self, name: str, start: int, stop: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of row-major ``name``, converted to ``dtype``."""
        self._check_conversion(name, dtype)
        values = self.reader.read_range(self._key(name), start, stop)
        self.bytes_read += values.numel() * values.element_size()
        return values if dtype is None else values.to(dtype)

    def _check_conversion(self, name: str, dtype: torch.dtype | None) -> None:
        if dtype is not None:
            check_conversion(self.dtype(name), dtype, self.origin, name)

    def close(self) -> None:
        self.reader.close()

"""One safetensors file written tensor by tensor: only one tensor is held at a time.

The header needs only names, shapes and dtypes, so it goes out first; each tensor is then asked
for, checked against its entry, written and dropped. The bytes go to a temp name and are fsynced;
the caller renames the file into place once every file of the set is complete.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from shardwise.checkpoint.files import safetensors_header, tensor_chunks
from shardwise.hf.errors import WeightsError
from shardwise.hf.names import TensorSpec

Producer = Callable[[str], torch.Tensor]
"""Returns the full tensor of a name (for a sharded model: gathered for this one call)."""


class HeldBytes:
    """Bytes of the tensors handed to :meth:`track` that are still alive, and their peak: how
    an exporter shows it never held more than one output tensor (plus its pieces) at a time.
    Each tensor's storage counts until the tensor is freed (a weakref finalizer)."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` from now until it is freed; returns it."""
        size = t.untyped_storage().nbytes()
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._drop, size)
        return t

    def _drop(self, size: int) -> None:
        self.now -= size


def temp_name(path: Path) -> Path:
    """Where ``path`` is written before its rename: ``<name>.tmp`` in the same directory."""
    return path.with_name(path.name + ".tmp")


def write_streamed(
    path: Path,
    tensors: Sequence[TensorSpec],
    produce: Producer,
    metadata: dict[str, str] | None = None,
) -> int:
    """Write ``tensors`` to ``temp_name(path)`` asking ``produce`` for each in turn; fsync.

    Args:
        path: the final file name (not created here: the caller renames the temp file).
        tensors: names, shapes and dtypes in file order.
        produce: called once per name, in order; must return a tensor of exactly that shape
            and dtype (CPU or not; it is copied to the host if needed).
        metadata: extra ``__metadata__`` strings (``format: pt`` is always set).

    Returns:
        Bytes written.

    Raises:
        WeightsError: naming the file and tensor, for a tensor of the wrong shape or dtype, a
            meta tensor (never initialized) or something that is not a tensor. The temp file is
            removed on any failure.
    """
    tmp = temp_name(path)
    head = safetensors_header([(t.name, t.dtype, t.shape) for t in tensors], metadata)
    written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            written += len(head)
            for spec in tensors:
                values = _checked(path, spec, produce(spec.name))
                for chunk in tensor_chunks(values):
                    f.write(chunk)
                    written += len(chunk)
                del values
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


def _checked(path: Path, spec: TensorSpec, value: object) -> torch.Tensor:
    """``value`` as a contiguous CPU tensor, after checking it matches ``spec``."""
    if not isinstance(value, torch.Tensor):
        raise WeightsError(
            f"the producer returned {type(value).__name__}, not a torch.Tensor", path, spec.name
        )
    if value.device.type == "meta":
        raise WeightsError(
            "is on the meta device: it was never initialized or loaded; initialize or load "
            "it before exporting",
            path,
            spec.name,
        )
    if tuple(value.shape) != tuple(spec.shape) or value.dtype != spec.dtype:
        raise WeightsError(
            f"the producer returned {list(value.shape)} {value.dtype} where the file's header "
            f"says {list(spec.shape)} {spec.dtype}",
            path,
            spec.name,
        )
    return value.detach().to("cpu").contiguous()

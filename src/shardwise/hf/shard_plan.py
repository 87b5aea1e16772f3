"""Which output file each tensor goes to, decided before any tensor exists.

Hugging Face's ``save_pretrained`` splits a state dict into files of whole tensors, walking the
tensors in order: a tensor that would push the current file past ``max_shard_size`` starts a new
file, and one larger than ``max_shard_size`` gets a file of its own (placed before the file being
filled). Because only names, shapes and dtypes are needed, every rank can compute the same plan
up front and then gather one file's tensors at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.bytesize import parse_bytes
from shardwise.checkpoint.files import SAFETENSORS_DTYPES
from shardwise.hf.model_dir import SAFE_WEIGHTS_NAME, shard_name
from shardwise.hf.names import TensorSpec


@dataclass(frozen=True)
class ShardPlan:
    """The output files, in writing order, and the tensors each holds, in their order."""

    files: tuple[tuple[str, tuple[TensorSpec, ...]], ...]
    """``(file name, tensors)`` per file."""
    total_size: int
    """Bytes of all tensors (the index's ``metadata.total_size``)."""

    @property
    def sharded(self) -> bool:
        """More than one file: an index is written next to them."""
        return len(self.files) > 1

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name, in writing order."""
        return {t.name: file for file, tensors in self.files for t in tensors}

    @property
    def total_parameters(self) -> int:
        """Elements of all tensors."""
        return sum(math.prod(t.shape) for _, tensors in self.files for t in tensors)


def nbytes(spec: TensorSpec) -> int:
    """Bytes the tensor takes in a safetensors file."""
    return math.prod(spec.shape) * spec.dtype.itemsize


def plan_shards(tensors: Sequence[TensorSpec], max_shard_size: int | str = "5GB") -> ShardPlan:
    """Assign ``tensors`` (in order) to files as ``save_pretrained`` does.

    Args:
        tensors: the tensors to write, each once (leave out tied duplicates).
        max_shard_size: bytes per file, an int or a string like ``"5GB"`` (10**9) or
            ``"500MiB"`` (2**20); a larger tensor gets a file of its own.

    Returns:
        The plan: ``model.safetensors`` for one file, else ``model-0000k-of-0000n.safetensors``.

    Raises:
        ValueError: no tensors, a repeated name, an unsupported dtype, or a bad size.
    """
    limit = parse_bytes(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {max_shard_size!r}")
    _check_tensors(tensors)
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for spec in tensors:
        size = nbytes(spec)
        if size > limit:
            groups.append([spec])
            continue
        if current_bytes + size > limit:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += size
    if current:
        groups.append(current)
    groups = [g for g in groups if g]
    files: tuple[tuple[str, tuple[TensorSpec, ...]], ...]
    if len(groups) == 1:
        files = ((SAFE_WEIGHTS_NAME, tuple(groups[0])),)
    else:
        files = tuple((shard_name(i + 1, len(groups)), tuple(g)) for i, g in enumerate(groups))
    return ShardPlan(files, sum(nbytes(t) for t in tensors))


def _check_tensors(tensors: Sequence[TensorSpec]) -> None:
    if not tensors:
        raise ValueError("no tensors to write; give at least one (name, shape, dtype)")
    seen: set[str] = set()
    for t in tensors:
        if not isinstance(t.name, str) or not t.name:
            raise ValueError(f"tensor names must be non-empty strings, got {t.name!r}")
        if t.name in seen:
            raise ValueError(f"tensor {t.name!r} is listed twice; write each tensor once")
        seen.add(t.name)
        if t.dtype not in SAFETENSORS_DTYPES:
            allowed = ", ".join(str(d) for d in SAFETENSORS_DTYPES)
            raise ValueError(f"tensor {t.name!r}: dtype {t.dtype} cannot be written; use {allowed}")
        if any(not isinstance(d, int) or d < 0 for d in t.shape):
            raise ValueError(f"tensor {t.name!r}: shape {t.shape} must be ints >= 0")

"""Offline tools: summarize, verify and consolidate a checkpoint without any process group."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from shardwise.bytesize import format_bytes
from shardwise.checkpoint.files import dtype_from_name, save_safetensors
from shardwise.checkpoint.integrity import read_manifest, verify
from shardwise.checkpoint.journal import resolve
from shardwise.checkpoint.layout import CheckpointError
from shardwise.checkpoint.reader import CheckpointReader

log = logging.getLogger("shardwise.checkpoint")

MODEL_PREFIX = "model/"


def inspect(path: Path | str) -> str:
    """A human-readable summary of a checkpoint (a ``step-N`` dir or a root: its latest).

    Lists step, world size, format version, tensor count, tensor bytes in total and per name
    prefix (``model``, ``optim``, ``master``...), file bytes, and the verification result.
    Never raises for a damaged checkpoint: the problem is part of the summary.
    """
    try:
        step_dir = resolve(path)
        manifest, _ = read_manifest(step_dir)
    except CheckpointError as exc:
        return f"checkpoint {path}\n  unreadable: {exc}"
    per_prefix: dict[str, list[int]] = {}
    for t in manifest.tensors.values():
        nbytes = t.numel * torch.empty(0, dtype=dtype_from_name(t.dtype)).element_size()
        prefix = t.name.split("/", 1)[0] if "/" in t.name else "(none)"
        acc = per_prefix.setdefault(prefix, [0, 0])
        acc[0] += 1
        acc[1] += nbytes
    total = sum(b for _, b in per_prefix.values())
    lines = [
        f"checkpoint {step_dir}",
        f"  step: {manifest.step}",
        f"  world size: {manifest.world_size}",
        f"  format version: {manifest.format_version}",
        f"  tensors: {len(manifest.tensors)}",
        f"  tensor bytes: {total} ({format_bytes(total)})",
        f"  files: {len(manifest.files)}, "
        f"{format_bytes(sum(f.size for f in manifest.files.values()))} on disk",
    ]
    for prefix in sorted(per_prefix):
        count, nbytes = per_prefix[prefix]
        lines.append(f"    {prefix}/: {count} tensors, {nbytes} bytes ({format_bytes(nbytes)})")
    _, message = verify_cli(step_dir)
    lines.append(f"  verification: {message}")
    return "\n".join(lines)


def verify_cli(path: Path | str) -> tuple[bool, str]:
    """``(True, "OK ...")`` if the checkpoint verifies, else ``(False, "FAILED: <problem>")``."""
    try:
        report = verify(path)
    except CheckpointError as exc:
        return False, f"FAILED: {exc}"
    return True, (
        f"OK: step {report.step}, {report.num_files} files, {report.bytes_checked} bytes checked"
    )


def export_consolidated(path: Path | str, out_file: Path | str) -> list[str]:
    """Write every ``model/`` tensor, full and with the prefix stripped, to one safetensors file.

    Floating tensors are cast to float32; others keep their stored dtype. The result loads into
    the plain (unsharded) model with ``model.load_state_dict(safetensors.torch.load_file(f))``.
    Tied weights appear once per name the engine saved. The checkpoint is verified first; the
    output is written with :func:`~shardwise.checkpoint.files.save_safetensors` (temp name,
    fsync, rename).

    Returns:
        The names written, sorted.
    """
    out = Path(out_file)
    tensors: dict[str, torch.Tensor] = {}
    with CheckpointReader(path, verify=True) as reader:
        for name in reader.names():
            if not name.startswith(MODEL_PREFIX):
                continue
            full = reader.read_full(name)
            tensors[name[len(MODEL_PREFIX) :]] = full.float() if full.is_floating_point() else full
    if not tensors:
        raise ValueError(f"{path} holds no tensor named '{MODEL_PREFIX}...'; nothing to export")
    save_safetensors(out, tensors)
    log.info(
        "exported %d model tensors (%d elements) to %s",
        len(tensors),
        sum(math.prod(t.shape) for t in tensors.values()),
        out,
    )
    return sorted(tensors)

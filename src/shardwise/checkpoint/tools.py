"""Offline tools: summarize, verify and consolidate a checkpoint without any process group."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from shardwise.bytesize import format_bytes
from shardwise.checkpoint.files import dtype_from_name, save_safetensors
from shardwise.checkpoint.integrity import read_manifest, verify
from shardwise.checkpoint.journal import resolve
from shardwise.checkpoint.layout import CheckpointError
from shardwise.checkpoint.reader import CheckpointReader

log = logging.getLogger("shardwise.checkpoint")

MODEL_PREFIX = "model/"
"""Saved names of a model's parameters (the engine's entries use these prefixes)."""
BUFFER_PREFIX = "buffer/"
OPTIM_PREFIX = "optim/"


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


def read_consolidated(path: Path | str) -> dict[str, torch.Tensor]:
    """The full model state of a checkpoint (a ``step-N`` dir or a root: its latest), verified
    first: every ``model/`` tensor (floating ones in fp32) and ``buffer/`` tensor (as stored),
    prefixes stripped, and each tied alias the engine recorded as its own copy, so the result is
    the saved module's ``state_dict()`` (a pipeline's: ``layers.{i}.*``, ``tied.{key}.*``; see
    :func:`read_plain` for the plain model's names). Needs no process group."""
    with CheckpointReader(path, verify=True) as reader:
        return _read_stored(reader, path)


def _read_stored(reader: CheckpointReader, path: Path | str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in reader.names():
        if name.startswith(MODEL_PREFIX):
            full = reader.read_full(name)
            out[name[len(MODEL_PREFIX) :]] = full.float() if full.is_floating_point() else full
        elif name.startswith(BUFFER_PREFIX):
            out[name[len(BUFFER_PREFIX) :]] = reader.read_full(name)
    for alias, first in reader.trainer_state.get("aliases", {}).items():
        out[alias] = out[first].clone()
    if not out:
        raise ValueError(
            f"{path} holds no tensor named '{MODEL_PREFIX}...' or '{BUFFER_PREFIX}...'; "
            "nothing to read"
        )
    return out


PLAIN_NAMES = "plain_names"
"""Key, in a checkpoint's caller values ("extra"), of ``{stored name: the plain model's name}``
for a module whose names are not the plain model's (a pipeline's ``layers.{i}.*``,
``tied.{key}.*``); ``PLAIN_ALIASES`` holds the plain model's tied aliases ``{name: name it
repeats}``. ``shardwise train`` records both for pipeline runs."""
PLAIN_ALIASES = "plain_aliases"


def plain_names_extra(names: dict[str, str], aliases: dict[str, str]) -> dict[str, Any]:
    """The caller values that let :func:`read_plain` give a pipeline checkpoint the plain model's
    names: ``names`` maps each stored name to the plain model's, ``aliases`` the plain model's
    state-dict names that repeat another tensor (e.g. a tied head) to it."""
    return {PLAIN_NAMES: dict(names), PLAIN_ALIASES: dict(aliases)}


def read_plain(path: Path | str) -> tuple[dict[str, torch.Tensor], str]:
    """:func:`read_consolidated` under the plain model's names, and a phrase saying which names
    those are. A pipeline checkpoint is renamed with the mapping its saver recorded
    (:func:`plain_names_extra`); one without a mapping keeps the pipeline's names, and the
    phrase says so."""
    with CheckpointReader(path, verify=True) as reader:
        stored = _read_stored(reader, path)
        state = reader.trainer_state
    extra = state.get("extra") or {}
    names: dict[str, str] | None = extra.get(PLAIN_NAMES)
    if names:
        missing = sorted(set(stored) - set(names))
        if missing:
            raise ValueError(
                f"{path} records the plain model's names but not for {missing[:3]}; "
                "the checkpoint was saved from a different model than its name mapping"
            )
        plain = {names[k]: v for k, v in stored.items()}
        for alias, first in extra.get(PLAIN_ALIASES, {}).items():
            plain[alias] = plain[first].clone()
        return plain, "under the plain model's names (renamed from the pipeline's)"
    if int(state.get("pp_size", 1)) > 1:
        return stored, (
            "under the pipeline's names (layers.{i}.*, tied.{key}.*), not a plain model's: the "
            "checkpoint records no mapping to them (shardwise train records one)"
        )
    return stored, "under the plain model's names"


def export_consolidated(path: Path | str, out_file: Path | str) -> tuple[list[str], str]:
    """Write :func:`read_plain` of a checkpoint to one safetensors file (temp name, fsync,
    rename: :func:`~shardwise.checkpoint.files.save_safetensors`). The file loads into the
    plain model with ``model.load_state_dict(safetensors.torch.load_file(out_file))`` (strict),
    from any layout (dp, tp, pp, pp x tp, ZeRO 0-3) whose names the checkpoint can map.

    Returns:
        The names written, sorted, and which names they are (see :func:`read_plain`).
    """
    tensors, naming = read_plain(path)
    save_safetensors(Path(out_file), tensors)
    log.info(
        "exported %d tensors (%d elements) of %s to %s %s",
        len(tensors),
        sum(math.prod(t.shape) for t in tensors.values()),
        path,
        out_file,
        naming,
    )
    return sorted(tensors), naming

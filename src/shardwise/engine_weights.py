"""An engine checkpoint as plain model weights: read, export, describe, and start from them.

:func:`read_model_state` returns every key of the plain model's ``state_dict()`` (parameters in
fp32, tied aliases included), :func:`export_model_state` writes it to one safetensors file, and
:func:`load_pretrained` starts an engine from such a file, a state dict or a checkpoint. None of
them needs a process group.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from shardwise.checkpoint.files import save_safetensors
from shardwise.checkpoint.layout import CheckpointError
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.engine_run_state import ENGINE_FORMAT, CheckpointableEngine
from shardwise.zero.checkpoint_entries import BUFFER_PREFIX, MODEL_PREFIX, ModelNames

log = logging.getLogger("shardwise.checkpoint")


def read_model_state(path: Path | str) -> dict[str, torch.Tensor]:
    """The full model state of a checkpoint (a step dir or a root: its latest), verified first:
    every key of the plain model's ``state_dict()``, parameters in fp32, tied aliases as
    separate copies. Needs no process group."""
    out: dict[str, torch.Tensor] = {}
    with CheckpointReader(path, verify=True) as reader:
        for name in reader.names():
            for prefix in (MODEL_PREFIX, BUFFER_PREFIX):
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = reader.read_full(name)
        for alias, first in reader.trainer_state.get("aliases", {}).items():
            out[alias] = out[first].clone()
    if not out:
        raise ValueError(f"{path} holds no model/ or buffer/ tensors; nothing to read")
    return out


def export_model_state(path: Path | str, out_file: Path | str) -> list[str]:
    """Write ``read_model_state(path)`` to one safetensors file (temp name, fsync, rename).

    The file loads into the plain model with
    ``model.load_state_dict(safetensors.torch.load_file(out_file))`` (strict). Returns the keys.
    """
    state = read_model_state(path)
    save_safetensors(out_file, state)
    log.info("exported %d tensors of %s to %s", len(state), path, out_file)
    return sorted(state)


def load_pretrained(
    engine: CheckpointableEngine, path_or_state_dict: Path | str | dict[str, torch.Tensor]
) -> None:
    """Start ``engine`` from full model weights; call on every rank (each reads all of them).

    Accepts a state dict, a ``.safetensors`` file (e.g. from ``export_model_state``), a
    ``torch.save``'d state dict, or a checkpoint directory (its weights only). Tied aliases the
    source lacks are filled from the name it has. Only weights and buffers change: optimizer
    states, steps and scheduler are left as they are (empty right after ``initialize``).
    Communicates nothing.
    """
    src = path_or_state_dict
    if isinstance(src, dict):
        state = dict(src)
    else:
        p = Path(src)
        if p.is_dir():
            state = read_model_state(p)
        elif p.suffix == ".safetensors" and p.is_file():
            state = load_file(str(p))
        elif p.is_file():
            state = torch.load(p, map_location="cpu", weights_only=True)
        else:
            raise ValueError(
                f"{p} does not exist; pass a state dict, a .safetensors file, a "
                f"torch.save file or a checkpoint directory"
            )
    for alias, first in ModelNames.of(engine.module).aliases.items():
        if alias not in state and first in state:
            state[alias] = state[first]
        elif first not in state and alias in state:
            state[first] = state[alias]
    engine.load_state_dict(state)


def describe(path: Path | str) -> str:
    """A few lines about the training run behind a checkpoint, from its trainer state."""
    try:
        with CheckpointReader(path, verify=False) as reader:
            s = reader.trainer_state
    except CheckpointError as exc:
        return f"  engine: unreadable ({exc})"
    if s.get("format", {}).get("name") != ENGINE_FORMAT["name"]:
        return "  engine: not an engine checkpoint (no engine trainer state)"
    return "\n".join(
        [
            f"  engine: global step {s['global_step']}, ZeRO stage {s['zero_stage']}, "
            f"precision {s['precision']}, dp size {s['dp_size']} of world {s['world_size']}",
            f"  optimizer: {s['optimizer']['class']}, {len(s['optimizer']['param_groups'])} "
            f"group(s); scheduler: {'yes' if s['lr_scheduler'] else 'none'}; "
            f"sampler: {'yes' if s['sampler'] else 'none'}",
            f"  tied aliases: {s['aliases'] or 'none'}",
        ]
    )

"""An engine checkpoint as plain model weights: read, export, describe, and start from them.

:func:`load_pretrained` starts an engine from full weights: a state dict, a safetensors file
(e.g. from ``shardwise.checkpoint.export_consolidated``) or a checkpoint, read with
``shardwise.checkpoint.read_consolidated``. None of them needs a process group.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file
from torch import nn

from shardwise.checkpoint.layout import CheckpointError
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.tools import read_consolidated
from shardwise.engine.run_state import ENGINE_FORMAT
from shardwise.zero.checkpoint_entries import ModelNames

log = logging.getLogger("shardwise.checkpoint")


class FullStateTarget(Protocol):
    """What takes full weights: a model (its tied names) and a full-state load."""

    module: nn.Module

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


def load_pretrained(
    engine: FullStateTarget, path_or_state_dict: Path | str | dict[str, torch.Tensor]
) -> None:
    """Start ``engine`` from full model weights; call on every rank (each reads all of them).

    Accepts a state dict, a ``.safetensors`` file (e.g. from ``export_consolidated``), a
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
            state = read_consolidated(p)
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

"""What a training run saves and loads: sharded checkpoints and the final model file.

Sharded checkpoints (engine, optimizer and data sampler position) go through ``Engine.save`` /
``Engine.resume`` into ``config.checkpoint_dir`` (``<run>/checkpoints``). Independently, rank 0
writes the full model weights to ``final_model.safetensors`` when a run ends (finished or
stopped); ``shardwise generate`` loads whichever of the two holds the later step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from shardwise.checkpoint import CheckpointError, CheckpointReader, save_safetensors
from shardwise.checkpoint.tools import plain_names_extra, read_consolidated
from shardwise.comm import objects
from shardwise.data.sampler import DistributedBatchSampler
from shardwise.engine.core import Engine
from shardwise.mesh import Axis, Mesh
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.train.parallel import BuiltModel, gpt_pipeline_names, state_aliases

log = logging.getLogger("shardwise.train")


def save(engine: Engine, sampler: DistributedBatchSampler, built: BuiltModel) -> Path:
    """Save engine, optimizer and sampler position as a checkpoint of ``engine.global_step``
    into ``engine.config.checkpoint_dir``; call on every rank, after ``engine.step()``.
    With ``config.async_save`` it returns once the state is copied to host memory. A pipeline
    run's checkpoint records the plain GPT's names of its weights (``checkpoint export`` gives
    those).

    Communicates: see ``shardwise.engine.checkpoint.save_engine``.
    """
    extra = plain_names_extra(built.gpt_names, built.aliases) if built.pipeline else None
    return engine.save(sampler=sampler, extra=extra)


def finish_saving(engine: Engine) -> None:
    """Block until a background save is committed (no-op for synchronous saves)."""
    engine.wait_for_checkpoint()


def resume(engine: Engine, sampler: DistributedBatchSampler) -> int | None:
    """Load the newest checkpoint under ``engine.config.checkpoint_dir`` that verifies into
    ``engine`` and ``sampler`` (``config.resume`` must be "auto"); call on every rank.
    Returns the step it holds, or None when there is none to resume from.
    """
    state = engine.resume(sampler=sampler)
    return None if state is None else engine.global_step


def save_final_model(
    engine: Engine, path: Path, step: int, is_writer: bool, built: BuiltModel, mesh: Mesh
) -> None:
    """Write the full model weights (fp32), under the plain GPT's names, to ``path``, tagged
    with ``step``; every rank calls it (the weights are gathered), the rank with ``is_writer``
    writes the file.

    Communicates (ZeRO stages 1-3): an all_gather per flat parameter buffer; under tensor
    parallelism one per split parameter over tp; under pipeline parallelism an
    all_gather_object of each pp rank's stage weights over pp.
    """
    state = engine.state_dict()
    if built.pipeline:
        mine = {built.gpt_names[name]: t for name, t in state.items()}
        state = built.gpt_state(objects.all_gather_object(mine, group=mesh.group(Axis.PP)))
    if not is_writer:
        return
    # tied weights (the head's and the token embedding's) come back as one tensor under two
    # names; safetensors stores each name separately, so each gets its own copy
    tensors = {k: (v.float() if v.is_floating_point() else v).clone() for k, v in state.items()}
    save_safetensors(path, tensors, metadata={"step": str(step)})
    log.info("wrote %s (step %d)", path, step)


def _from_checkpoint(root: Path) -> tuple[dict[str, torch.Tensor], int] | None:
    """The model state and step of the newest committed checkpoint under ``root``."""
    if not root.is_dir():
        return None
    try:
        with CheckpointReader(root, verify=False) as reader:
            step_dir, step = reader.path, reader.step
        return read_consolidated(step_dir), step
    except (CheckpointError, FileNotFoundError) as exc:
        log.warning("cannot read a checkpoint under %s: %s", root, exc)
        return None


def _from_model_file(path: Path) -> tuple[dict[str, torch.Tensor], int] | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            step = int((f.metadata() or {}).get("step", -1))
            return {k: f.get_tensor(k) for k in f.keys()}, step
    except (SafetensorError, OSError, ValueError) as exc:  # truncated or overwritten
        log.warning("%s is damaged (%s): using the newest valid checkpoint instead", path, exc)
        return None


def load_model(cfg: GPTConfig, final_model: Path, checkpoints: Path) -> tuple[GPT, int, str]:
    """Build ``GPT(cfg)`` with the newest weights a run saved: the last checkpoint's or the
    final model file's, whichever holds the later step.

    Returns the model (eval mode, fp32), the step of its weights and where they came from.
    """
    found: list[tuple[int, str, dict[str, torch.Tensor]]] = []
    for loaded, where in (
        (_from_model_file(final_model), str(final_model)),
        (_from_checkpoint(checkpoints), str(checkpoints)),
    ):
        if loaded is not None:
            found.append((loaded[1], where, loaded[0]))
    if not found:
        raise ValueError(
            f"no saved weights: neither {final_model} nor a checkpoint under "
            f"{checkpoints} exists (did the run get to save?)"
        )
    step, where, tensors = max(found, key=lambda item: item[0])
    model = GPT(cfg)
    if "tok_emb.weight" not in tensors:  # a pipeline-parallel run's checkpoint: its names
        renamed = gpt_pipeline_names(model)
        tensors = {renamed.get(k, k): v for k, v in tensors.items()}
        tensors.update({a: tensors[f] for a, f in state_aliases(model).items() if f in tensors})
    own = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for name, ref in own.items():
        if name not in tensors:
            raise ValueError(
                f"{where} has no weights for {name!r}: it was saved from a different model"
            )
        state[name] = tensors[name].float().reshape(ref.shape)
    model.load_state_dict(state)
    return model.eval(), step, where

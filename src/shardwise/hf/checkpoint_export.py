"""A shardwise checkpoint as a Hugging Face model directory, tensor by tensor, with no process
group: each output tensor is read whole from the stored boxes that cover it (any layout: dp,
tp, pp, ZeRO 0-3), written, and dropped before the next is read.

Names: a checkpoint of a plain model stores the model's own names; a pipeline checkpoint is
renamed with the mapping its saver recorded (``shardwise.checkpoint.tools.plain_names_extra``,
which ``shardwise train`` records); tied aliases are stored once and written once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shardwise.checkpoint.tools import BUFFER_PREFIX, MODEL_PREFIX, PLAIN_NAMES
from shardwise.hf.checkpoint_source import CheckpointWeights
from shardwise.hf.names import TensorSpec
from shardwise.hf.shard_plan import ShardPlan
from shardwise.hf.side_files import ConfigLike
from shardwise.hf.stream_file import HeldBytes
from shardwise.hf.writer import write_model_dir

log = logging.getLogger("shardwise.checkpoint")


def export_checkpoint(
    path: Path | str,
    out_dir: Path | str,
    max_shard_size: int | str = "5GB",
    *,
    config: ConfigLike | None = None,
    generation_config: ConfigLike | None = None,
    tokenizer_dir: Path | str | None = None,
    held: HeldBytes | None = None,
) -> ShardPlan:
    """Write the model of checkpoint ``path`` (a root: its latest step, or a ``step-N``
    directory) to ``out_dir`` as ``write_model_dir`` does: model tensors in fp32 (the master
    weights), buffers as stored. Every file is verified (sha256) first.

    Args:
        config / generation_config / tokenizer_dir: see ``write_model_dir`` (a checkpoint
            holds no Hugging Face config; give the model's ``config.json`` for a directory
            ``from_pretrained`` loads).
        held: counts the output tensors alive at once (one at a time here).

    Raises:
        ValueError: a pipeline checkpoint that records no mapping to the plain model's names.
        CheckpointError: a damaged or missing checkpoint.
    """
    with CheckpointWeights(path, verify=True) as source:
        stored = {
            n.split("/", 1)[1]: n.startswith(MODEL_PREFIX)
            for n in source.reader.names()
            if n.startswith((MODEL_PREFIX, BUFFER_PREFIX))
        }
        rename = _plain_names(source, path)
        specs, origin = [], {}
        for name, is_model in stored.items():
            dtype = source.dtype(name)
            if is_model and dtype.is_floating_point:
                dtype = torch.float32
            out_name = rename.get(name, name)
            specs.append(TensorSpec(out_name, source.shape(name), dtype))
            origin[out_name] = name
        tracker = held if held is not None else HeldBytes()

        def produce(out_name: str) -> torch.Tensor:
            spec = specs_by[out_name]
            zeros = (0,) * len(spec.shape)
            return tracker.track(source.read_box(origin[out_name], zeros, spec.shape, spec.dtype))

        specs_by = {s.name: s for s in specs}
        plan = write_model_dir(
            out_dir,
            specs,
            produce,
            max_shard_size,
            config=config,
            generation_config=generation_config,
            tokenizer_dir=tokenizer_dir,
        )
    log.info("exported checkpoint %s to %s (%d tensors)", path, out_dir, len(specs))
    return plan


def _plain_names(source: CheckpointWeights, path: Path | str) -> dict[str, str]:
    state = source.reader.trainer_state
    names: dict[str, str] = dict((state.get("extra") or {}).get(PLAIN_NAMES) or {})
    if not names and int(state.get("pp_size", 1)) > 1:
        raise ValueError(
            f"{path} is a pipeline checkpoint that records no mapping to the plain model's "
            "names (layers.{i}.* / tied.{key}.*); save it with extra="
            "plain_names_extra(names, aliases) (shardwise train does) to export it"
        )
    return names

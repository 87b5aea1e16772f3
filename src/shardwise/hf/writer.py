"""Writing a Hugging Face model directory one tensor at a time.

:func:`write_model_dir` plans the files from names, shapes and dtypes (:func:`plan_shards`),
then writes them in plan order, asking a ``produce(name)`` callback for each tensor: a caller
with a sharded model gathers that one tensor (every rank can run the same plan and join the same
gathers in the same order), so no rank holds more than one tensor of the output at a time.

Every weights file goes to a temp name and is fsynced; only when all are complete are they
renamed into place, after any old index is removed and before the new index is written, so a
failed or interrupted export leaves no final-named weights file from this export and a directory
never pairs an index with files it does not describe. Files of an earlier export that the new
one does not replace (``model-*-of-*.safetensors``, a lone ``model.safetensors``) are removed.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.files import fsync_dir, write_atomically
from shardwise.hf.model_dir import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
)
from shardwise.hf.names import TensorSpec
from shardwise.hf.shard_plan import ShardPlan, nbytes, plan_shards
from shardwise.hf.side_files import ConfigLike, config_dict, json_bytes, tokenizer_file_names
from shardwise.hf.stream_file import Producer, temp_name, write_streamed

logger = logging.getLogger(__name__)

_WEIGHTS_FILE_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def write_model_dir(
    out_dir: Path | str,
    tensors: Sequence[TensorSpec],
    produce: Producer,
    max_shard_size: int | str = "5GB",
    *,
    config: ConfigLike | None = None,
    generation_config: ConfigLike | None = None,
    tokenizer_dir: Path | str | None = None,
) -> ShardPlan:
    """Write a model directory that ``transformers`` ``from_pretrained`` loads.

    Args:
        out_dir: created if needed; an earlier export there is replaced.
        tensors: what to write, in order, each name once (leave out tied duplicates, as
            ``save_pretrained`` does: the first name of a tie is kept).
        produce: ``produce(name)`` returns that full tensor with exactly the listed shape and
            dtype; called once per name, in plan order (file by file).
        max_shard_size: bytes per weights file (``"5GB"``, ``"500MB"`` or an int).
        config: the model's config (dict, JSON path or ``PretrainedConfig``) -> ``config.json``.
        generation_config: likewise -> ``generation_config.json``.
        tokenizer_dir: a directory whose tokenizer files are copied alongside.

    Returns:
        The plan that was written (files and the tensors of each).

    Raises:
        WeightsError: a produced tensor of the wrong shape or dtype, or a meta tensor (naming
            file and tensor); nothing final-named is written for the weights then.
        ValueError: bad ``tensors`` or ``max_shard_size``.
    """
    plan = plan_shards(tensors, max_shard_size)
    # Configs are serialized before any weight is written: a bad one fails with nothing written.
    side = {}
    if config is not None:
        side[CONFIG_NAME] = json_bytes(_with_dtype(config_dict(config, CONFIG_NAME), plan))
    if generation_config is not None:
        side[GENERATION_CONFIG_NAME] = json_bytes(
            config_dict(generation_config, GENERATION_CONFIG_NAME)
        )
    tokenizer_files = tokenizer_file_names(tokenizer_dir) if tokenizer_dir is not None else []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out, plan, produce)
    for name, data in side.items():
        write_atomically(out / name, data)
    for path in tokenizer_files:
        write_atomically(out / path.name, path.read_bytes())
    fsync_dir(out.resolve())
    logger.info(
        "wrote %d tensors (%d bytes) in %d file(s) to %s",
        len(plan.weight_map),
        plan.total_size,
        len(plan.files),
        out,
    )
    return plan


def index_json(plan: ShardPlan) -> dict[str, object]:
    """The ``model.safetensors.index.json`` content of a sharded plan."""
    return {
        "metadata": {"total_size": plan.total_size, "total_parameters": plan.total_parameters},
        "weight_map": dict(sorted(plan.weight_map.items())),
    }


def _with_dtype(config: dict[str, Any], plan: ShardPlan) -> dict[str, Any]:
    """``config`` with ``dtype`` set, when it has none, to the floating dtype holding most bytes
    (``save_pretrained`` records the model's dtype there; ``from_pretrained`` reads it)."""
    if config.get("dtype") is not None or config.get("torch_dtype") is not None:
        return config
    by_dtype: Counter[torch.dtype] = Counter()
    for _, specs in plan.files:
        for t in specs:
            if t.dtype.is_floating_point:
                by_dtype[t.dtype] += nbytes(t)
    if by_dtype:
        config = {**config, "dtype": str(by_dtype.most_common(1)[0][0]).removeprefix("torch.")}
    return config


def _write_weights(out: Path, plan: ShardPlan, produce: Producer) -> None:
    finals = [out / name for name, _ in plan.files]
    done: list[Path] = []
    try:
        for path, (_, specs) in zip(finals, plan.files):
            write_streamed(path, specs, produce)
            done.append(path)
    except BaseException:
        for path in done:
            temp_name(path).unlink(missing_ok=True)
        raise
    # The old index goes first: until the new one exists, the directory names no stale file.
    (out / SAFE_WEIGHTS_INDEX_NAME).unlink(missing_ok=True)
    for path in finals:
        os.replace(temp_name(path), path)
    if plan.sharded:
        write_atomically(out / SAFE_WEIGHTS_INDEX_NAME, json_bytes(index_json(plan)))
    keep = {p.name for p in finals}
    for old in out.iterdir():
        if _WEIGHTS_FILE_RE.match(old.name) and old.name not in keep and old.is_file():
            logger.info("removing %s, left by an earlier export", old)
            old.unlink()
    if not plan.sharded:
        assert keep == {SAFE_WEIGHTS_NAME}, keep

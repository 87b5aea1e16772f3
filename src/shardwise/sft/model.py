"""A local Hugging Face causal LM directory: its config, tokenizer and weights (no network).

``load_base_weights`` is the one place the base weights enter the model; it reads every tensor
through ``shardwise.hf.open_weights`` into the full model on each rank (the model must fit one
rank for now).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import hf

log = logging.getLogger("shardwise.sft")


class ModelDirError(ValueError):
    """A model directory that cannot be fine-tuned: the message names what to change."""


def check_model_dir(model_dir: Path) -> Any:
    """The directory's ``PretrainedConfig``; ``ModelDirError`` for a missing config, an
    unknown model type, a model that is not a causal LM or a missing tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        raise ModelDirError(f"{model_dir} has no config.json: pass a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelDirError(
            f"{model_dir}/config.json names a model type transformers does not know: {first}"
        ) from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ModelDirError(
            f"{model_dir}: model type {config.model_type!r} is not a causal language model"
        )
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelDirError(
            f"{model_dir} has no tokenizer.json: save the tokenizer with the model "
            "(tokenizer.save_pretrained(dir)); a fast tokenizer is needed"
        )
    return config


def load_tokenizer(model_dir: Path) -> Any:
    """The directory's tokenizer (fast, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def build_model(config: Any, seed: int = 0) -> nn.Module:
    """The model of ``config`` in fp32 with SDPA attention and dropout as configured; weights
    random until ``load_base_weights``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", torch_dtype=torch.float32
    )
    return model


def load_base_weights(model: nn.Module, model_dir: Path) -> int:
    """Fill ``model`` with the directory's weights (every rank reads all of them); strict:
    ``WeightsError`` names what is missing, unexpected or of the wrong shape. Returns the bytes
    read. Communicates nothing."""
    spec = hf.model_spec(model)
    with hf.open_weights(model_dir) as source:
        mapping = hf.map_names(spec, source, strict=True)
        own = model.state_dict()
        state = {}
        for name, stored in mapping.source_of.items():
            shape = tuple(own[name].shape)
            state[name] = source.read_box(stored, (0,) * len(shape), shape, own[name].dtype)
        model.load_state_dict(state, strict=False)
        return int(source.bytes_read)


def decoder_layer_classes(model: nn.Module) -> list[str]:
    """Class names of the model's repeated blocks (``_no_split_modules``): ZeRO-3's units."""
    names = list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    return [n for n in names if n in present]

"""peft LoRA adapters on disk, and LoRA merged into the base weights.

A peft model names its tensors ``base_model.model.<module>.base_layer.weight`` (the frozen base)
and ``base_model.model.<module>.lora_A.<adapter>.weight`` / ``lora_B`` (``lora_embedding_A`` /
``lora_embedding_B`` for embeddings, which are parameters, hence no ``.weight``). An adapter
directory stores only the LoRA tensors, with the adapter name dropped from their names
(``...q_proj.lora_A.weight``), in ``adapter_model.safetensors`` next to ``adapter_config.json``;
``peft.PeftModel.from_pretrained(base, dir)`` loads it. Merging folds each pair into its base
weight: ``W + B @ A * alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), transposed where the base
stores ``[in, out]`` (``fan_in_fan_out``, GPT-2's ``Conv1D``) and always for embeddings.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.files import fsync_dir, write_atomically
from shardwise.hf.errors import WeightsError
from shardwise.hf.model_dir import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from shardwise.hf.names import PEFT_PREFIX, TensorSpec
from shardwise.hf.side_files import ConfigLike, config_dict, json_bytes
from shardwise.hf.stream_file import Producer, temp_name, write_streamed

LORA_MODULE_PARTS = ("lora_A", "lora_B")
"""LoRA modules (their tensor is ``<part>.<adapter>.weight``)."""
LORA_PARAM_PARTS = ("lora_embedding_A", "lora_embedding_B")
"""LoRA parameters of embeddings (their tensor is ``<part>.<adapter>``)."""
_SAVED_SUFFIXES = tuple(f".{p}.weight" for p in LORA_MODULE_PARTS) + tuple(
    f".{p}" for p in LORA_PARAM_PARTS
)
_ALL_PARTS = (*LORA_MODULE_PARTS, *LORA_PARAM_PARTS)
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable_token_indices",
}


def check_lora_config(adapter_config: ConfigLike) -> dict[str, Any]:
    """The adapter config as a dict, after checking it is a LoRA config these helpers handle
    exactly (plain LoRA or rsLoRA, bias "none"); ValueError naming the setting otherwise."""
    cfg = config_dict(adapter_config, ADAPTER_CONFIG_NAME)
    kind = str(getattr(cfg.get("peft_type"), "value", cfg.get("peft_type")))
    if kind != "LORA":
        raise ValueError(f"adapter config has peft_type {kind!r}; only LORA adapters are handled")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(
                f"adapter config sets {key}={cfg[key]!r}: {what} is not handled here; save "
                f"this adapter with peft's save_pretrained"
            )
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter config sets bias={cfg['bias']!r}; only bias='none' is handled")
    return cfg


def adapter_key(state_name: str, adapter_name: str = "default") -> str | None:
    """The name peft saves a peft model's tensor under, or None if it is not a LoRA tensor of
    ``adapter_name`` (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    for part in LORA_MODULE_PARTS:
        suffix = f".{part}.{adapter_name}.weight"
        if state_name.endswith(suffix):
            return state_name.removesuffix(suffix) + f".{part}.weight"
    for part in LORA_PARAM_PARTS:
        suffix = f".{part}.{adapter_name}"
        if state_name.endswith(suffix):
            return state_name.removesuffix(suffix) + f".{part}"
    return None


def write_adapter_dir(
    out_dir: Path | str,
    tensors: Sequence[TensorSpec],
    produce: Producer,
    adapter_config: ConfigLike,
) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` for ``PeftModel``.

    Args:
        out_dir: created if needed.
        tensors: the adapter's tensors under their saved names (:func:`adapter_key`), in order.
        produce: ``produce(saved_name)`` returns that full tensor (exact shape and dtype).
        adapter_config: the LoRA config (a ``peft.LoraConfig``, a dict or a JSON path).

    Returns:
        The weights file written. The config is written after it, so a directory with an
        ``adapter_config.json`` from this call always has its weights.

    Raises:
        WeightsError / ValueError: a bad tensor (naming it) or an unsupported config; the
            weights file is then not created.
    """
    cfg = check_lora_config(adapter_config)
    cfg["inference_mode"] = True
    for spec in tensors:
        if not spec.name.startswith(PEFT_PREFIX) or not spec.name.endswith(
            tuple(f".{p}.weight" for p in LORA_MODULE_PARTS)
            + tuple(f".{p}" for p in LORA_PARAM_PARTS)
        ):
            raise ValueError(
                f"tensor {spec.name!r} is not a saved LoRA name like "
                f"'{PEFT_PREFIX}<module>.lora_A.weight'; map names with adapter_key()"
            )
    config_bytes = json_bytes(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ADAPTER_WEIGHTS_NAME
    write_streamed(path, tensors, produce)
    os.replace(temp_name(path), path)
    write_atomically(out / ADAPTER_CONFIG_NAME, config_bytes)
    fsync_dir(out.resolve())
    return path


def merged_name(state_name: str) -> str:
    """A peft model's base tensor name as the merged model names it
    (``base_model.model.model.x.q_proj.base_layer.weight`` -> ``model.x.q_proj.weight``)."""
    return state_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


@dataclass(frozen=True)
class LoraDelta:
    """The LoRA pair to fold into one base weight, and how."""

    lora_a: str
    """peft state name of A: ``[r, in]`` (``[r, num_embeddings]`` for an embedding)."""
    lora_b: str
    """peft state name of B: ``[out, r]`` (``[embedding_dim, r]``)."""
    rank: int
    scaling: float
    """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    transpose: bool
    """The base weight is stored ``[in, out]``: add ``(B @ A).T``."""


def lora_merge_plan(
    state_names: Iterable[str], adapter_config: ConfigLike, adapter_name: str = "default"
) -> dict[str, tuple[str, LoraDelta | None]]:
    """For each tensor of the merged model: the peft state name to read its base from, and the
    LoRA pair to fold into it (None: copied as is). LoRA tensors themselves are left out.

    Args:
        state_names: the peft model's ``state_dict`` names.
        adapter_config: its LoRA config (``r``, ``lora_alpha``, ``rank_pattern``,
            ``alpha_pattern``, ``use_rslora``, ``fan_in_fan_out``).
        adapter_name: the adapter to merge.
    """
    cfg = check_lora_config(adapter_config)
    names = list(state_names)
    lora = {n for n in names if _is_lora(n)}
    plan: dict[str, tuple[str, LoraDelta | None]] = {}
    for name in names:
        if name in lora:
            continue
        delta = None
        module, sep, leaf = name.rpartition(".base_layer.")
        if sep and leaf == "weight":
            delta = _delta(module, names=lora, cfg=cfg, adapter=adapter_name)
        plan[merged_name(name)] = (name, delta)
    return plan


def merge_lora(
    name: str,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    delta: LoraDelta,
) -> torch.Tensor:
    """``weight + B @ A * scaling`` (transposed per ``delta``), in ``weight``'s dtype.

    The product is formed in fp32 (as peft does on CPU for half precisions) and added to the
    fp32 weight, then cast back. ``name`` is the merged tensor's name, for errors.

    Raises:
        WeightsError: A or B does not have the rank the config gives, or the update's shape is
            not the weight's (a wrong ``fan_in_fan_out`` on a non-square weight).
    """
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != delta.rank:
        raise WeightsError(
            f"LoRA A {list(lora_a.shape)} and B {list(lora_b.shape)} do not have rank "
            f"{delta.rank} (the adapter config's r for this module)",
            tensor=name,
        )
    update = lora_b.float() @ lora_a.float()
    if delta.transpose:
        update = update.T
    if update.shape != weight.shape:
        raise WeightsError(
            f"LoRA update {list(update.shape)} does not fit the weight {list(weight.shape)}; "
            f"check fan_in_fan_out in the adapter config",
            tensor=name,
        )
    return (weight.float() + update * delta.scaling).to(weight.dtype)


def _is_lora(name: str) -> bool:
    return any(
        f".{p}." in name or name.endswith(f".{p}") for p in (*LORA_MODULE_PARTS, *LORA_PARAM_PARTS)
    )


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """peft's per-module override: the first pattern matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _delta(module: str, names: set[str], cfg: dict[str, Any], adapter: str) -> LoraDelta | None:
    embedding = f"{module}.lora_embedding_A.{adapter}" in names
    if embedding:
        a, b = (f"{module}.lora_embedding_{x}.{adapter}" for x in "AB")
    else:
        a, b = (f"{module}.lora_{x}.{adapter}.weight" for x in "AB")
    if a not in names or b not in names:
        return None
    key = module.removeprefix(PEFT_PREFIX)
    rank = int(_pattern_value(cfg.get("rank_pattern") or {}, key, cfg["r"]))
    alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, key, cfg["lora_alpha"]))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return LoraDelta(a, b, rank, scaling, embedding or bool(cfg.get("fan_in_fan_out")))

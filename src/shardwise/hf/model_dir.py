"""File names of a Hugging Face model directory, and which file holds each tensor.

A model directory holds ``config.json``, maybe ``generation_config.json`` and tokenizer files,
and the weights as one ``model.safetensors`` or as ``model-00001-of-0000N.safetensors`` shards
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
{tensor: file}}``). A peft adapter directory holds ``adapter_model.safetensors`` and
``adapter_config.json``. Every file an index names must be a plain name inside the directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardwise.hf.errors import WeightsError

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
)
"""Files a tokenizer may be saved as; those present are copied next to exported weights."""


def shard_name(index: int, count: int) -> str:
    """``model-00002-of-00005.safetensors`` for the 2nd of 5 files (``index`` counts from 1)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files of a source and, for a sharded one, its index."""

    files: tuple[Path, ...]
    """Every weights file, in the order the index first names them."""
    weight_map: dict[str, Path] | None
    """Tensor name -> file from the index; None for one file (every tensor of its header)."""
    index: Path | None
    """The index file, when there is one."""


def weight_files(path: Path | str) -> WeightFiles:
    """The weights files of a model directory or of one ``.safetensors`` file.

    In a directory, ``model.safetensors`` is used when present (as ``from_pretrained`` does),
    else ``model.safetensors.index.json`` with its shards, else ``adapter_model.safetensors``.

    Raises:
        WeightsError: no weights found, an unreadable index, a file name that is not a plain
            name inside the directory, or a shard named in the index that does not exist.
    """
    root = Path(path)
    if root.is_file():
        return WeightFiles((root,), None, None)
    if not root.is_dir():
        raise WeightsError("does not exist; give a model directory or a .safetensors file", root)
    if (root / SAFE_WEIGHTS_NAME).is_file():
        return WeightFiles((root / SAFE_WEIGHTS_NAME,), None, None)
    if (root / SAFE_WEIGHTS_INDEX_NAME).is_file():
        weight_map = _indexed_files(root / SAFE_WEIGHTS_INDEX_NAME)
        files = tuple(dict.fromkeys(weight_map.values()))
        return WeightFiles(files, weight_map, root / SAFE_WEIGHTS_INDEX_NAME)
    if (root / ADAPTER_WEIGHTS_NAME).is_file():
        return WeightFiles((root / ADAPTER_WEIGHTS_NAME,), None, None)
    raise WeightsError(
        f"holds no {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME} or {ADAPTER_WEIGHTS_NAME}; "
        f"only safetensors weights are read (convert .bin files with safetensors first)",
        root,
    )


def _indexed_files(index_path: Path) -> dict[str, Path]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"cannot read the index: {exc}", index_path) from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError('has no "weight_map" object of tensor name -> file name', index_path)
    root = index_path.parent
    out: dict[str, Path] = {}
    for name, file in weight_map.items():
        if not _is_plain_name(file):
            raise WeightsError(
                f"the index names file {file!r} for it, which is not a plain file name inside "
                f"{root} (no path separators, '..' or absolute paths)",
                index_path,
                name,
            )
        out[name] = root / file
    for name, file_path in out.items():
        if not file_path.is_file():
            raise WeightsError(
                f"the index puts it in {file_path.name}, which does not exist in {root}",
                index_path,
                name,
            )
    return out


def _is_plain_name(file: object) -> bool:
    return (
        isinstance(file, str)
        and file not in ("", ".", "..")
        and "/" not in file
        and "\\" not in file
        and "\0" not in file
        and not Path(file).is_absolute()
    )

"""The files that travel with weights: configs as JSON, tokenizer files copied as they are."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardwise.hf.errors import WeightsError
from shardwise.hf.model_dir import TOKENIZER_FILES

ConfigLike = Any
"""A config: a dict, a JSON file to copy, or an object with ``to_dict()`` (a
``transformers.PretrainedConfig``, ``GenerationConfig`` or ``peft`` config)."""


def config_dict(config: ConfigLike, what: str) -> dict[str, Any]:
    """``config`` as a plain dict (read from the file when it is a path)."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightsError(f"cannot read {what}: {exc}", path) from exc
        if not isinstance(loaded, dict):
            raise WeightsError(f"{what} is not a JSON object", path)
        return loaded
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(
            f"{what} must be a dict, a path to a JSON file or an object with to_dict() "
            f"(e.g. a transformers PretrainedConfig), got {type(config).__name__}"
        )
    out = to_dict()
    if not isinstance(out, dict):
        raise TypeError(f"{what}.to_dict() returned {type(out).__name__}, not a dict")
    return out


def json_bytes(data: Mapping[str, Any]) -> bytes:
    """``data`` as indented JSON with sorted keys (dtypes, enums and sets made plain)."""
    return (json.dumps(data, indent=2, sort_keys=True, default=_plain) + "\n").encode()


def _plain(value: object) -> object:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    raise TypeError(f"{type(value).__name__} {value!r} cannot be written as JSON")


def tokenizer_file_names(source_dir: Path | str) -> list[Path]:
    """The tokenizer files (see ``TOKENIZER_FILES``) present in ``source_dir``."""
    src = Path(source_dir)
    if not src.is_dir():
        raise WeightsError("is not a directory; give the directory holding the tokenizer", src)
    return [src / name for name in TOKENIZER_FILES if (src / name).is_file()]

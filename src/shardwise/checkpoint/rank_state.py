"""A rank's own state (RNG states...) as one safetensors file: tensors, plus JSON for the rest.

Nothing is pickled, so loading a rank state never runs code from the file. A value may hold
JSON values (None, bool, int, float, str, lists, dicts with str keys), tuples, torch tensors
and numpy arrays of plain numeric dtypes, nested as deep as needed; it comes back with the same
types. Each tensor or array is stored as a safetensors tensor ``t<i>``; the structure, with tags
in place of them, is JSON in the file's metadata under ``shardwise.rank_state``::

    {"__tuple__": [...]}                                   a tuple
    {"__tensor__": "t0"}                                   a torch tensor
    {"__ndarray__": "t1", "dtype": "uint32", "shape": [624]}   a numpy array (its bytes as U8)
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from shardwise.checkpoint.files import SAFETENSORS_DTYPES, read_safetensors_metadata

META_KEY = "shardwise.rank_state"
_TAGS = ("__tuple__", "__tensor__", "__ndarray__")
_ARRAY_KINDS = "biuf"  # bool, signed, unsigned, floating: no object or structured dtypes


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{where}: tensor dtype {value.dtype} cannot be stored")
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _ARRAY_KINDS:
            raise TypeError(f"{where}: numpy dtype {value.dtype} cannot be stored")
        key = f"t{len(tensors)}"
        raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8).copy()
        tensors[key] = torch.from_numpy(raw)
        return {"__ndarray__": key, "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) and k not in _TAGS for k in value):
            raise TypeError(f"{where}: dict keys must be str (and not {', '.join(_TAGS)})")
        return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(
        f"{where} is a {type(value).__name__}; a rank state holds JSON values, tuples, "
        f"torch tensors and numpy arrays only (nothing is pickled)"
    )


def encode_rank_state(value: Any) -> bytes:
    """The bytes of the safetensors file holding ``value``; TypeError naming what cannot be
    stored."""
    tensors: dict[str, torch.Tensor] = {}
    doc = _encode(value, tensors, "rank_state")
    return save_safetensors(tensors, metadata={META_KEY: json.dumps(doc)})


def _tensor(tensors: dict[str, torch.Tensor], key: Any) -> torch.Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise ValueError(f"refers to tensor {key!r}, which the file does not hold")
    return tensors[key]


def _decode(doc: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(doc, list):
        return [_decode(v, tensors) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "__tuple__" in doc:
        return tuple(_decode(v, tensors) for v in doc["__tuple__"])
    if "__tensor__" in doc:
        return _tensor(tensors, doc["__tensor__"])
    if "__ndarray__" in doc:
        dtype = np.dtype(str(doc["dtype"]))
        if dtype.kind not in _ARRAY_KINDS:
            raise ValueError(f"numpy dtype {dtype} is not a plain numeric dtype")
        raw = _tensor(tensors, doc["__ndarray__"]).numpy().tobytes()
        return np.frombuffer(raw, dtype=dtype).reshape(doc["shape"]).copy()
    return {k: _decode(v, tensors) for k, v in doc.items()}


def decode_rank_state(data: bytes) -> Any:
    """The value stored by :func:`encode_rank_state` in ``data``.

    Raises:
        ValueError when the bytes are not such a file.
    """
    try:
        meta = read_safetensors_metadata(data)
        if META_KEY not in meta:
            raise ValueError(f"no {META_KEY!r} metadata")
        tensors = load_safetensors(data) if len(data) > 8 else {}
        return _decode(json.loads(meta[META_KEY]), tensors)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"not a readable rank state ({exc})") from exc

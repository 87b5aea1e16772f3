"""Which stored tensor fills each of a model's own ``state_dict`` names.

A checkpoint's names need not be the model's: a base model's weights (``layers.0...``) load into
a task model (``model.layers.0...``) and the other way round, a peft-saved full model carries
``base_model.model.``, tied weights (``lm_head.weight`` = ``model.embed_tokens.weight``) are
stored once, and buffers that are not persistent are not the model's to load. :func:`map_names`
settles all of that from names, shapes and dtypes alone (a meta-device model is enough), before
any tensor is read, the way ``from_pretrained`` does: per stored key, strip the base-model
prefix if the model expects the stripped name, else add it if the model expects that.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import nn

from shardwise.hf.errors import WeightsError

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""What a peft model adds in front of the wrapped model's names."""

MAX_LISTED = 10
"""Names shown per category in an error message (the rest are counted)."""


class TensorSpec(NamedTuple):
    """A tensor's name, shape and dtype: what is expected before anything is read."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightCatalog(Protocol):
    """What name mapping needs from a source: its names, shapes and dtypes."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...


@dataclass(frozen=True)
class ModelSpec:
    """What a model expects to load, from its (possibly meta-device) instance."""

    tensors: dict[str, TensorSpec]
    """``state_dict`` names (in order) -> shape and dtype."""
    tied: dict[str, str] = field(default_factory=dict)
    """name -> the first ``state_dict`` name sharing its tensor (tied weights)."""
    base_model_prefix: str = ""
    """The attribute holding the base model (``model`` for Llama, ``transformer`` for GPT-2)."""
    ignore_missing: tuple[str, ...] = ()
    """Regexes of names that may be absent from a checkpoint without being reported."""
    ignore_unexpected: tuple[str, ...] = ()
    """Regexes of stored names that are dropped without being reported."""
    buffers: frozenset[str] = frozenset()
    """Every buffer name, persistent or not: stored ones the model does not load are ignored."""
    elsewhere: frozenset[str] = frozenset()
    """Names of the whole model held by other processes (another pipeline stage's): stored
    ones are neither loaded here nor unexpected."""


def model_spec(model: nn.Module) -> ModelSpec:
    """The :class:`ModelSpec` of ``model`` (works on a meta-device model: nothing is read).

    Tied weights are parameters that are the same object under several names, plus those a
    Hugging Face model declares (``all_tied_weights_keys``); the ignore lists are the model's
    ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected``.
    """
    state = model.state_dict(keep_vars=True)
    tensors = {n: TensorSpec(n, tuple(t.shape), t.dtype) for n, t in state.items()}
    first_of: dict[int, str] = {}
    tied: dict[str, str] = {}
    named: list[tuple[str, torch.Tensor]] = [*model.named_parameters(remove_duplicate=False)]
    named += model.named_buffers(remove_duplicate=False)
    order = {n: i for i, n in enumerate(state)}
    for name, t in sorted((x for x in named if x[0] in order), key=lambda x: order[x[0]]):
        canonical = first_of.setdefault(id(t), name)
        if canonical != name:
            tied[name] = canonical
    declared = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in dict(declared).items():
        if target in tensors and source in tensors and target != source:
            tied.setdefault(target, tied.get(source) or source)
    return ModelSpec(
        tensors=tensors,
        tied=tied,
        base_model_prefix=str(getattr(model, "base_model_prefix", "") or ""),
        ignore_missing=tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
        buffers=frozenset(n for n, _ in model.named_buffers(remove_duplicate=False)),
    )


class Mismatch(NamedTuple):
    """A stored tensor whose shape or dtype kind does not fit the model's tensor."""

    name: str
    source_name: str
    stored: tuple[tuple[int, ...], torch.dtype]
    expected: tuple[tuple[int, ...], torch.dtype]
    file: Path | None = None
    """The file holding the stored tensor, when the source tells."""

    def describe(self) -> str:
        (s_shape, s_dtype), (e_shape, e_dtype) = self.stored, self.expected
        where = f" in {self.file.name}" if self.file is not None else ""
        return (
            f"{self.name} (stored as {self.source_name!r}{where} {list(s_shape)} {s_dtype}, "
            f"model has {list(e_shape)} {e_dtype})"
        )


@dataclass(frozen=True)
class NameMapping:
    """The outcome of :func:`map_names`."""

    source_of: dict[str, str]
    """model name -> stored name to read it from (tied names point at the stored one)."""
    missing: list[str]
    """Model names nothing stored fills (they keep their initialization)."""
    unexpected: list[str]
    """Stored names the model has no place for (not read)."""
    mismatched: list[Mismatch]
    """Stored tensors whose shape or dtype kind does not fit (not read)."""
    tied_from: dict[str, str]
    """Model names filled from a tied name's stored tensor: name -> the tied model name."""

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def map_names(spec: ModelSpec, source: WeightCatalog, strict: bool = True) -> NameMapping:
    """Map every name of ``spec`` onto the stored names of ``source`` and check shapes and
    dtype kinds (float vs int) before anything is read.

    Args:
        spec: what the model expects (:func:`model_spec`).
        source: the stored tensors (a :class:`~shardwise.hf.source.SafetensorsSource`).
        strict: raise when anything is missing, unexpected or mismatched; otherwise log and
            return them listed (mismatched tensors are then left out of ``source_of``).

    Raises:
        WeightsError: strict and the names do not match exactly (every problem named), or two
            stored names map onto one model name (always: which one to load is ambiguous).
    """
    stored = source.names()
    source_of: dict[str, str] = {}
    unexpected: list[str] = []
    for key in stored:
        name = _model_name(key, spec)
        if name is None:
            if not _ignored(key, spec):
                unexpected.append(key)
            continue
        if name in source_of:
            raise WeightsError(
                f"stored names {source_of[name]!r} and {key!r} both map onto the model's "
                f"{name!r}; remove one of them from the checkpoint",
                _origin(source),
                name,
            )
        source_of[name] = key
    tied_from = _fill_tied(spec, source_of)
    mismatched = [m for name, key in source_of.items() if (m := _mismatch(spec, source, name, key))]
    for m in mismatched:
        del source_of[m.name]
    missing = [
        n
        for n in spec.tensors
        if n not in source_of
        and n not in {m.name for m in mismatched}
        and not any(re.search(p, n) for p in spec.ignore_missing)
    ]
    mapping = NameMapping(
        {n: source_of[n] for n in spec.tensors if n in source_of},
        missing,
        unexpected,
        mismatched,
        tied_from,
    )
    _report(mapping, strict, _origin(source))
    return mapping


def _model_name(key: str, spec: ModelSpec) -> str | None:
    """The model name stored key ``key`` fills, or None, as ``from_pretrained`` renames."""
    candidates = [key]
    if key.startswith(PEFT_PREFIX):
        candidates.append(key[len(PEFT_PREFIX) :])
    prefix = f"{spec.base_model_prefix}." if spec.base_model_prefix else ""
    for k in candidates:
        if k in spec.tensors:
            return k
        if prefix and k.startswith(prefix) and k[len(prefix) :] in spec.tensors:
            return k[len(prefix) :]
        if prefix and prefix + k in spec.tensors:
            return prefix + k
    return None


def _ignored(key: str, spec: ModelSpec) -> bool:
    """A stored name the model does not load and ``from_pretrained`` does not report."""
    bare = key.removeprefix(PEFT_PREFIX)
    prefix = f"{spec.base_model_prefix}." if spec.base_model_prefix else ""
    names = {key, bare, prefix + bare, bare.removeprefix(prefix) if prefix else bare}
    skipped = spec.buffers | spec.elsewhere
    return bool(names & skipped) or any(re.search(p, key) for p in spec.ignore_unexpected)


def _fill_tied(spec: ModelSpec, source_of: dict[str, str]) -> dict[str, str]:
    """Point each unfilled tied name at the stored tensor of a filled name of its tie group."""
    groups: dict[str, list[str]] = {}
    for name, canonical in spec.tied.items():
        groups.setdefault(canonical, [canonical]).append(name)
    tied_from: dict[str, str] = {}
    for members in groups.values():
        filled = next((m for m in members if m in source_of), None)
        if filled is None:
            continue
        for m in members:
            if m not in source_of:
                source_of[m] = source_of[filled]
                tied_from[m] = filled
    return tied_from


def _mismatch(spec: ModelSpec, source: WeightCatalog, name: str, key: str) -> Mismatch | None:
    want = spec.tensors[name]
    shape, dtype = tuple(source.shape(key)), source.dtype(key)
    if shape == want.shape and dtype.is_floating_point == want.dtype.is_floating_point:
        return None
    return Mismatch(name, key, (shape, dtype), (want.shape, want.dtype), _file_of(source, key))


def _file_of(source: WeightCatalog, key: str) -> Path | None:
    """The file holding stored tensor ``key``, for sources that tell (safetensors)."""
    info = getattr(source, "info", None)
    file = getattr(info(key), "file", None) if callable(info) else None
    return Path(file) if isinstance(file, (str, Path)) else None


def _listed(what: str, items: list[str]) -> str:
    more = f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return f"{what} {len(items)}: {', '.join(items[:MAX_LISTED])}{more}"


def _origin(source: WeightCatalog) -> Path | None:
    origin = getattr(source, "origin", None)
    return Path(origin) if isinstance(origin, (str, Path)) else None


def _report(mapping: NameMapping, strict: bool, origin: Path | None) -> None:
    parts = []
    if mapping.missing:
        parts.append(_listed("missing", mapping.missing))
    if mapping.unexpected:
        parts.append(_listed("unexpected", mapping.unexpected))
    if mapping.mismatched:
        parts.append(_listed("mismatched", [m.describe() for m in mapping.mismatched]))
    if not parts:
        return
    summary = "; ".join(parts)
    if strict:
        raise WeightsError(
            f"does not match the model's state_dict: {summary}; fix the checkpoint or the model "
            f"config, or load with strict=False to keep those tensors' initialization",
            origin,
        )
    logger.warning("loading %s leniently: %s", origin, summary)

"""Streaming load: each rank reads from a checkpoint only the bytes it keeps.

A source is a Hugging Face model directory (``model.safetensors`` or shards with an index), a
plain ``.safetensors`` file, or a shardwise checkpoint at any layout. Names are mapped onto the
model's own as ``from_pretrained`` does (``shardwise.hf.map_names``: tied weights, base-model
prefixes; strict raises naming every missing, unexpected or mismatched tensor, lenient logs and
lists them). For each parameter the rank reads the part of its local tensor it keeps (at ZeRO-3
its flat shard range, which may start and end inside a row; under tp its slice of the whole
tensor from the placement's split dims, vocabulary padding left zero; both at once when
combined), in boxes of at most a third of the largest tensor, converted to the dtype it is kept
in on copy (bf16 on disk into fp32 masters without a full-size copy). A pipeline stage (built
by ``shardwise.parallelize``) is matched under the whole model's names, each stage reading its
own tensors. The ranks then agree on the outcome: a failure on any rank raises on all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from shardwise.checkpoint.entries import flat_range_boxes, intersect, local_slices
from shardwise.checkpoint.layout import MANIFEST_NAME
from shardwise.comm import objects
from shardwise.comm.groups import Group
from shardwise.deferred.peak import InitPeak
from shardwise.engine.targets import ParamTargets, Target
from shardwise.hf import (
    CheckpointWeights,
    ModelSpec,
    NameMapping,
    WeightsError,
    map_names,
    model_spec,
    open_weights,
)
from shardwise.mesh import AXIS_ORDER
from shardwise.parallel.pipeline.stage import PipelineModule
from shardwise.parallel.placement import Placement

log = logging.getLogger("shardwise.checkpoint")

Source = Any  # a SafetensorsSource or CheckpointWeights: names, shape, dtype, read_box, origin

__all__ = ["Source", "load_pretrained", "on_every_rank", "open_source", "stream_into"]


def open_source(weights: Path | str | Source) -> Source:
    """A weights source for ``weights``: an open source as is; a directory holding a
    checkpoint manifest (a ``step-N``) or ``step-*`` directories: a shardwise checkpoint;
    else a Hugging Face model directory or a ``.safetensors`` file."""
    if not isinstance(weights, (str, Path)):
        return weights
    path = Path(weights)
    if path.is_dir() and (
        (path / MANIFEST_NAME).is_file() or any(path.glob(f"step-*/{MANIFEST_NAME}"))
    ):
        return CheckpointWeights(path)
    return open_weights(path)


def mapping_for(
    module: torch.nn.Module, targets: ParamTargets, source: Source, strict: bool
) -> NameMapping:
    """The model's names mapped onto ``source``'s, with each parameter's whole (unsplit)
    shape. A pipeline stage is matched under the whole model's names (``plain_names``), the
    other stages' tensors neither loaded nor unexpected; the mapping is keyed by the stage's
    own names."""
    spec = model_spec(module)
    whole = {id(t.param): t.placement.full_shape for t in targets}
    state = module.state_dict(keep_vars=True)
    tensors = {
        n: s._replace(shape=tuple(whole.get(id(state[n]), s.shape)))
        for n, s in spec.tensors.items()
    }
    spec = dataclasses.replace(spec, tensors=tensors)
    plain = module.plain_names if isinstance(module, PipelineModule) else {}
    if not plain:
        return map_names(spec, source, strict)
    return _stage_mapping(spec, plain, source, strict)


def _stage_mapping(
    spec: ModelSpec, plain: dict[str, str], source: Source, strict: bool
) -> NameMapping:
    """``map_names`` for one pipeline stage under the whole model's names; a tied module's
    copies on several stages each read the one stored tensor."""
    unnamed = [n for n in spec.tensors if n not in plain]
    if unnamed:
        raise ValueError(
            f"pipeline tensors {unnamed[:5]} have no name in the whole model: build the "
            f"pipeline with shardwise.parallelize (which records the names) to load weights"
        )
    own = {plain[n]: t._replace(name=plain[n]) for n, t in spec.tensors.items()}
    renamed = dataclasses.replace(
        spec,
        tensors=own,
        tied={plain[a]: plain[b] for a, b in spec.tied.items() if plain[a] != plain[b]},
        buffers=frozenset(plain.get(n, n) for n in spec.buffers),
        elsewhere=frozenset(plain.values()) - set(own),
    )
    found = map_names(renamed, source, strict)
    stage = {n: plain[n] for n in spec.tensors}
    return dataclasses.replace(
        found,
        source_of={n: found.source_of[p] for n, p in stage.items() if p in found.source_of},
    )


def read_local(
    source: Source,
    key: str,
    where: Placement,
    start: int,
    stop: int,
    dtype: torch.dtype,
    peak: InitPeak,
) -> torch.Tensor:
    """Elements ``[start, stop)`` of this rank's flattened local tensor of ``where`` (its tp
    slice, zero padding past the whole tensor's end), read from stored tensor ``key`` as
    ``dtype``. Only elements inside the range and the whole tensor are read: one box per piece
    of the rank's slice (several for a blocked split, e.g. its heads of q, of k and of v)."""
    local = where.local_shape()
    pieces = where.real_pieces()
    out = torch.zeros(stop - start, dtype=dtype)
    for box, pos in flat_range_boxes(local, start, stop):
        values = out[pos - start : pos - start + math.prod(box[1])].view(box[1])
        for at, whole, size in pieces:
            part = intersect(box, (at, size))
            if part is None:
                continue  # padding, or another block
            offsets = tuple(w + p - a for w, p, a in zip(whole, part[0], at))
            got = source.read_box(key, offsets, part[1], None)
            peak.note(out.nbytes + 2 * got.nbytes)
            values[local_slices(part, box)].copy_(got)
    return out


def _kept_dtype(target: Target) -> torch.dtype:
    flat = target.flat
    if flat is not None and flat.trainable:
        return flat.dtypes.master
    return target.param.dtype


def _stream_param(
    source: Source, key: str, target: Target, chunk_numel: int, peak: InitPeak
) -> None:
    start, stop = target.kept_range()
    dtype = _kept_dtype(target)
    row = math.prod(target.placement.local_shape()[1:]) or 1
    step = max(row, chunk_numel // row * row)
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        values = read_local(source, key, target.placement, lo, hi, dtype, peak)
        target.write(lo, values)


def stream_into(
    module: torch.nn.Module,
    targets: ParamTargets,
    source: Source,
    strict: bool,
    peak: InitPeak,
) -> NameMapping:
    """Read every parameter this rank keeps (its kept range) and every persistent buffer from
    ``source`` into ``targets`` / the module; returns the name mapping (what was missing is
    left unfilled in ``targets``). Communicates nothing.

    Raises:
        WeightsError: naming the file and tensor (a mismatch in strict mode, a damaged file).
    """
    mapping = mapping_for(module, targets, source, strict)
    largest = max((t.param.numel() for t in targets), default=1)
    chunk = max(1, largest // 3)
    for target in targets:
        key = mapping.source_of.get(target.name)
        if key is None:
            continue
        _stream_param(source, key, target, chunk, peak)
        targets.filled.add(id(target.param))
    params = {id(p) for p in module.parameters()}
    for name, t in module.state_dict(keep_vars=True).items():
        key = mapping.source_of.get(name)
        if key is None or id(t) in params:
            continue
        value = source.read_box(key, (0,) * t.dim(), tuple(t.shape), t.dtype)
        with torch.no_grad():
            t.copy_(value)
    log.info("read %d bytes from %s", source.bytes_read, source.origin)
    return mapping


def load_pretrained(
    engine: Any, weights: Path | str | Source, *, strict: bool = True
) -> NameMapping:
    """Load ``weights`` into ``engine`` (any engine, right after ``initialize``), each rank
    reading only the pieces of every tensor it keeps (see the module docstring); call on every
    rank. Lenient (``strict=False``): parameters the source lacks keep their values, and the
    mapping returned lists them. Optimizer states are untouched. Communicates: see
    ``on_every_rank``.

    Raises:
        WeightsError: on every rank, naming the file and tensor at fault (a strict mismatch, a
            damaged file), as raised on the first rank that found it.
    """

    def load() -> NameMapping:
        targets = ParamTargets(engine.module, engine._where, engine.placements)
        with open_source(weights) as source:
            return stream_into(engine.module, targets, source, strict, engine.init_peak)

    return on_every_rank(engine, load)


_T = TypeVar("_T")


def on_every_rank(engine: Any, fn: Callable[[], _T]) -> _T:
    """``fn()`` (a load, which communicates nothing) on every rank of ``engine``, then raise on
    every rank if it raised on any: the ranks that failed re-raise their own error, the others
    a ``WeightsError`` quoting the first failed rank's. A rank may fail alone (a pipeline stage
    checks its own tensors, a rank reads only its own pieces); without this the others would
    go on and wait for it in their first collective.

    Communicates: one all_gather_object over every rank of the engine (its mesh, else its dp
    group)."""
    mesh = engine.mesh
    everyone: Group = engine.dp_group if mesh is None else mesh.group(*AXIS_ORDER)
    failure: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # any failure: the other ranks must not be left waiting
        failure = exc
    said = None if failure is None else f"{type(failure).__name__}: {failure}"
    every = objects.all_gather_object(said, group=everyone)
    if failure is not None:
        raise failure
    failed = [(r, m) for r, m in zip(everyone.ranks, every) if m is not None]
    if failed:
        rank, message = failed[0]
        raise WeightsError(f"loading the weights failed on rank {rank} ({message})")
    return result  # type: ignore[return-value]

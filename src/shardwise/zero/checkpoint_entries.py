"""ZeRO's flat buffers as saved boxes: which logical tensors a checkpoint holds, and which parts
of them this rank writes and reads.

Names the manifest uses (one logical tensor each, full shape = the parameter's or buffer's):

- ``model/<param>``: fp32 master values, whatever the compute dtype;
- ``optim/<param>/<key>``: element-wise optimizer states (``exp_avg``, ``momentum_buffer``...);
- ``buffer/<name>``: persistent buffers, floating ones in fp32.

A parameter split by a parallel layer (tensor parallelism) is stored at its whole, unpadded
shape, each rank's piece at its offsets (``param_layout``); a piece other ranks of a mesh axis
besides dp hold copies of is written by the first of them only. Parameters go by their first
name in ``module.named_parameters()``; a tied parameter's other
names (state-dict aliases) are kept in the trainer state, not stored twice.

Who writes what: a flat buffer's ``[shard_start, shard_stop)`` is this rank's to write. At stages
1-3 the master holds exactly that range; at stage 0 every rank holds the whole flat, and writing
only that part shares the write bandwidth over the ranks. Parameters outside flat buffers
(frozen ones at stages 0-2, replicated) are split evenly over the ranks. Buffers: the ranks the
engine names (one holder of each). A
parameter's part of a flat range is a flat range of the parameter, saved as its few boxes
(``entries_of_flat_range``).

Who reads what: each rank reads exactly the ranges its master and optimizer pieces cover now
(``read_range``: the boxes of that range), whatever layout, world size or stage wrote them, so a
checkpoint loads at any world size. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.entries import ShardEntry
from shardwise.checkpoint.files import dtype_from_name, dtype_name
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.tools import BUFFER_PREFIX, MODEL_PREFIX, OPTIM_PREFIX
from shardwise.zero.flat_param import FlatParam
from shardwise.zero.param_layout import ParamLayout, layout_of, range_entries, read_range
from shardwise.zero.partition import ShardPiece, pieces_in

Layouts = Mapping[int, ParamLayout]
"""id(parameter) -> its layout in the saved tensor (absent: not split, written whole)."""

ScalarStates = dict[str, dict[str, dict[str, Any]]]
"""param name -> state key -> ``{"value": number, "dtype": name or None}``."""


def model_key(name: str) -> str:
    return f"{MODEL_PREFIX}{name}"


def optim_key(name: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{name}/{key}"


def buffer_key(name: str) -> str:
    return f"{BUFFER_PREFIX}{name}"


@dataclass(frozen=True)
class ModelNames:
    """How the module's state-dict keys map onto the stored logical tensors."""

    params: dict[int, str]  # id(parameter) -> its canonical name
    buffers: dict[str, torch.Tensor]  # canonical buffer name -> buffer
    aliases: dict[str, str]  # other state-dict key -> canonical name of the same tensor

    @classmethod
    def of(cls, module: nn.Module) -> ModelNames:
        params = {id(p): name for name, p in module.named_parameters()}
        seen = dict(params)
        buffers: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"state-dict entry {key!r} is not a tensor (extra state); "
                    f"engine checkpoints store tensors only"
                )
            first = seen.setdefault(id(value), key)
            if first != key:
                aliases[key] = first
            elif id(value) not in params:
                buffers[key] = value
        return cls(params, buffers, aliases)


def even_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``[0, numel)`` cut into ``parts`` near-equal contiguous ranges."""
    return numel * index // parts, numel * (index + 1) // parts


def _slot_names(flat: FlatParam, names: ModelNames) -> dict[int, str]:
    """slot offset -> canonical parameter name, for one flat buffer."""
    return {s.offset: names.params[id(p)] for s, p in zip(flat.slots, flat.params)}


def _opt_of(flat: FlatParam) -> dict[int, tuple[ShardPiece, nn.Parameter]]:
    """slot offset -> (optimizer piece, optimizer parameter): at most one per slot."""
    return {pc.slot.offset: (pc, op) for pc, op in zip(flat.opt_pieces, flat.opt_params)}


def _scalar(name: str, key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"value": value.item(), "dtype": dtype_name(value.dtype)}
    if value is None or isinstance(value, (bool, int, float)):
        return {"value": value, "dtype": None}
    raise ValueError(
        f"optimizer state {key!r} of {name!r} is a {type(value).__name__}; "
        f"engine checkpoints store tensors and numbers only"
    )


def _split_state(
    name: str, op: nn.Parameter, state: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(element-wise states, scalar states) of one optimizer parameter."""
    tensors, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != op.shape:
                raise ValueError(
                    f"optimizer state {key!r} of {name!r} has shape "
                    f"{tuple(value.shape)}, not the parameter piece's "
                    f"{tuple(op.shape)}: the optimizer is not element-wise"
                )
            tensors[key] = value.detach()
        else:
            scalars[key] = _scalar(name, key, value)
    return tensors, scalars


def flat_entries(
    flats: list[FlatParam],
    optimizer: torch.optim.Optimizer,
    names: ModelNames,
    layouts: Layouts,
) -> tuple[list[ShardEntry], ScalarStates]:
    """This rank's boxes of ``model/`` and ``optim/`` from the flat buffers (at each
    parameter's place in its global tensor, ``layouts``), and the scalar optimizer states of
    every parameter piece it holds."""
    entries: list[ShardEntry] = []
    scalars: ScalarStates = {}
    for f in flats:
        slot_name, opt_of = _slot_names(f, names), _opt_of(f)
        layout = {s.offset: layout_of(layouts, p) for s, p in zip(f.slots, f.params)}
        for pc, op in opt_of.values():
            name = slot_name[pc.slot.offset]
            _, found = _split_state(name, op, optimizer.state.get(op, {}))
            if found:
                scalars[name] = found
        for wp in pieces_in(f.slots, f.shard_start, f.shard_stop):
            name, where = slot_name[wp.slot.offset], layout[wp.slot.offset]
            lo = wp.slot.offset + wp.param_start - f.opt_start
            values = f.master[lo : lo + wp.numel].detach().float()
            entries += range_entries(model_key(name), where, wp.param_start, values)
            if wp.slot.offset not in opt_of:
                continue
            pc, op = opt_of[wp.slot.offset]
            states, _ = _split_state(name, op, optimizer.state.get(op, {}))
            a, b = wp.param_start - pc.param_start, wp.param_stop - pc.param_start
            for key, value in states.items():
                entries += range_entries(
                    optim_key(name, key), where, wp.param_start, value.reshape(-1)[a:b]
                )
    return entries, scalars


def outside_params(
    module: nn.Module, flats: list[FlatParam], frozen: bool = True
) -> Iterator[tuple[str, nn.Parameter]]:
    """Parameters that live outside flat buffers (frozen ones at stages 0-2), by name
    (``frozen=False``: only trainable ones)."""
    inside = {id(p) for f in flats for p in f.params}
    for name, p in module.named_parameters():
        if id(p) not in inside and (frozen or p.requires_grad):
            yield name, p


def saved_flats(flats: list[FlatParam], frozen: bool) -> list[FlatParam]:
    """The flat buffers a checkpoint holds: all, or (``frozen=False``) the trainable ones."""
    return [f for f in flats if frozen or f.trainable]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def replicated_entries(
    module: nn.Module,
    flats: list[FlatParam],
    names: ModelNames,
    rank: int,
    size: int,
    layouts: Layouts,
    buffers: Mapping[str, torch.Tensor],
    frozen: bool = True,
) -> list[ShardEntry]:
    """This rank's part of each parameter outside flat buffers (an even flat split over the
    ``size`` ranks; ``frozen=False``: trainable ones only) and ``buffers`` (those this rank
    writes, by name) whole."""
    entries = []
    for name, p in outside_params(module, flats, frozen):
        lo, hi = even_range(p.numel(), size, rank)
        flat = _fp32(p.detach().reshape(-1)[lo:hi])
        entries += range_entries(model_key(name), layout_of(layouts, p), lo, flat)
    for name, b in buffers.items():
        whole = _fp32(b.detach())
        entries.append(ShardEntry(buffer_key(name), tuple(b.shape), (0,) * b.dim(), whole))
    return entries


def expected_entries(
    module: nn.Module, names: ModelNames, layouts: Layouts, frozen: bool = True
) -> dict[str, tuple[int, ...]]:
    """The stored name and global shape of every parameter (``frozen=False``: every trainable
    one) and buffer of ``module``."""
    expected = {
        model_key(n): layout_of(layouts, p).global_shape
        for n, p in module.named_parameters()
        if frozen or p.requires_grad
    }
    expected.update({buffer_key(n): tuple(b.shape) for n, b in names.buffers.items()})
    return expected


def check_model_matches(
    reader: CheckpointReader,
    expected: Mapping[str, tuple[int, ...]],
    ignored: Collection[str] = (),
) -> None:
    """Every parameter and buffer of ``expected`` (``expected_entries``, of the whole model)
    is stored with its shape, and nothing else is (but ``ignored`` names, which may be);
    else ValueError naming the first differences."""
    stored = {
        n: reader.global_shape(n)
        for n in reader.names()
        if n.startswith((MODEL_PREFIX, BUFFER_PREFIX)) and n not in ignored
    }
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    shapes = [
        f"{n} {stored[n]} (model: {expected[n]})"
        for n in sorted(expected)
        if n in stored and stored[n] != expected[n]
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"checkpoint {reader.path} does not fit this model: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}, other shapes "
            f"{shapes[:5]}; build the model the checkpoint was saved from"
        )


def _optim_keys(reader: CheckpointReader) -> dict[str, list[str]]:
    """param name -> stored element-wise state keys."""
    out: dict[str, list[str]] = {}
    for n in reader.names():
        if n.startswith(OPTIM_PREFIX):
            param, key = n[len(OPTIM_PREFIX) :].rsplit("/", 1)
            out.setdefault(param, []).append(key)
    return out


def _scalar_tensor(spec: dict[str, Any], device: torch.device) -> Any:
    if spec.get("dtype") is None:
        return spec["value"]
    return torch.tensor(spec["value"], dtype=dtype_from_name(spec["dtype"]), device=device)


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def load_flats(
    flats: list[FlatParam],
    optimizer: torch.optim.Optimizer,
    reader: CheckpointReader,
    names: ModelNames,
    scalars: ScalarStates,
    layouts: Layouts,
) -> None:
    """Fill every master range and optimizer piece this rank holds from ``reader``, reading
    only the boxes of each parameter's global tensor that this rank's pieces cover.

    The parameters themselves are refreshed afterwards by ``publish_master``."""
    optim_keys, group_of = _optim_keys(reader), _group_of(optimizer)
    for f in flats:
        slot_name = _slot_names(f, names)
        layout = {s.offset: layout_of(layouts, p) for s, p in zip(f.slots, f.params)}
        with torch.no_grad():
            for pc in pieces_in(f.slots, f.opt_start, f.opt_stop):
                values = read_range(
                    reader,
                    model_key(slot_name[pc.slot.offset]),
                    layout[pc.slot.offset],
                    pc.param_start,
                    pc.param_stop,
                )
                f.master[pc.shard_start : pc.shard_start + pc.numel].copy_(values)
        for pc, op in zip(f.opt_pieces, f.opt_params):
            name = slot_name[pc.slot.offset]
            state: dict[str, Any] = {}
            for key in optim_keys.get(name, []):
                values = read_range(
                    reader,
                    optim_key(name, key),
                    layout[pc.slot.offset],
                    pc.param_start,
                    pc.param_stop,
                )
                dtype = op.dtype if values.is_floating_point() else values.dtype
                state[key] = values.to(device=op.device, dtype=dtype)
            group = group_of.get(id(op), {})
            on_device = bool(group.get("capturable") or group.get("fused"))
            for key, spec in scalars.get(name, {}).items():
                state[key] = _scalar_tensor(spec, op.device if on_device else torch.device("cpu"))
            optimizer.state.pop(op, None)
            if state:
                optimizer.state[op] = state


def load_replicated(
    module: nn.Module,
    flats: list[FlatParam],
    reader: CheckpointReader,
    names: ModelNames,
    layouts: Layouts,
    frozen: bool = True,
) -> None:
    """Load every parameter outside flat buffers (this rank's piece; ``frozen=False``: the
    trainable ones) and every buffer, whole, on every rank."""
    with torch.no_grad():
        for name, p in outside_params(module, flats, frozen):
            values = read_range(reader, model_key(name), layout_of(layouts, p), 0, p.numel())
            p.data.copy_(values.reshape(p.shape))
        for name, b in names.buffers.items():
            b.data.copy_(reader.read_full(buffer_key(name)).reshape(b.shape))

"""An engine's model as a Hugging Face directory, one tensor at a time, from any layout.

Every rank lists the tensors its pipeline stage owns (whole shapes, a tied tensor once, a tied
pipeline copy only on its first holder); the lists are joined over pp, so every rank knows the
same output tensors and computes the same file plan (``shardwise.hf.plan_shards``). The writer
(the rank at coordinate 0 on every mesh axis) then walks the plan file by file; for each tensor
every rank of the owning stage gathers it whole (its ZeRO pieces over the shard group, then its
tensor-parallel pieces, padding cut) and the owner of the writer's pp line sends it to the
writer, which writes it and drops it before the next. No rank holds more than one output
tensor (plus the transient pieces of its gather).

peft LoRA models: ``adapter_only`` writes the adapter (``PeftModel.from_pretrained`` loads it),
``merge`` the base model with every LoRA pair folded in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shardwise.comm import objects, ops
from shardwise.comm.groups import Group
from shardwise.engine.placements import EnginePlacements
from shardwise.hf import (
    TensorSpec,
    adapter_key,
    check_lora_config,
    lora_merge_plan,
    merge_lora,
    plan_shards,
    write_adapter_dir,
    write_model_dir,
)
from shardwise.hf.model_dir import CONFIG_NAME, GENERATION_CONFIG_NAME
from shardwise.hf.side_files import ConfigLike, config_dict, json_bytes, tokenizer_file_names
from shardwise.hf.stream_file import HeldBytes
from shardwise.mesh import AXIS_ORDER, Axis, Mesh
from shardwise.parallel.pipeline.stage import PipelineModule
from shardwise.zero.flat_param import FlatParam
from shardwise.zero.param_gather import gather_param_master
from shardwise.zero.partition import ParamSlot

log = logging.getLogger("shardwise")


class ExportableEngine(Protocol):
    """What the export reads of an engine."""

    module: nn.Module
    mesh: Mesh | None
    dp_group: Group
    placements: EnginePlacements
    _where: dict[int, tuple[FlatParam, ParamSlot]]


@dataclass
class ExportReport:
    """What ``save_pretrained`` wrote (the same on every rank)."""

    path: Path
    """The output directory."""
    tensors: list[str] = field(default_factory=list)
    """Names written, in writing order."""
    peak_held_bytes: int = 0
    """This rank's most bytes of output tensors alive at once during the export (storage of
    each gathered tensor, counted until it is freed)."""


@dataclass(frozen=True)
class _Item:
    spec: TensorSpec
    owner: int
    """The pp rank whose stage holds it (0 without a pipeline)."""


class _Exporter:
    """The gathers of one export: ``fetch(name)`` on every rank, in the same order."""

    def __init__(
        self, engine: ExportableEngine, names: Mapping[str, str] | None, dtype: torch.dtype | None
    ) -> None:
        self.engine = engine
        self.mesh = engine.mesh
        module = engine.module
        self.pipe = module if isinstance(module, PipelineModule) else None
        self.local = _local_tensors(module, self.pipe, names)
        self.dtype = dtype
        mine = [(n, self._spec(n, t)) for n, t in self.local.items()]
        self.pp_rank, self.pp_group = 0, None
        if self.pipe is not None and self.mesh is not None:
            self.pp_rank, self.pp_group = self.mesh.rank(Axis.PP), self.mesh.group(Axis.PP)
            every = objects.all_gather_object(mine, group=self.pp_group)
        else:
            every = [mine]
        self.items: dict[str, _Item] = {}
        for owner, listed in enumerate(every):
            for name, spec in listed:
                if name in self.items:
                    raise ValueError(f"tensor {name!r} is held by two pipeline stages")
                self.items[name] = _Item(spec, owner)
        # the writer: the first rank of every rank (coordinate 0 on every mesh axis)
        self.everyone = engine.dp_group if self.mesh is None else self.mesh.group(*AXIS_ORDER)
        self.is_writer = self.everyone.rank == 0
        coords = [] if self.mesh is None else [self.mesh.rank(a) for a in AXIS_ORDER]
        assert not self.is_writer or not any(coords), "the first rank is at coordinate 0"
        self.writer_line = all(c == 0 for a, c in zip(AXIS_ORDER, coords) if a != Axis.PP)
        self.held = HeldBytes()

    def _spec(self, name: str, t: torch.Tensor) -> TensorSpec:
        where = self.engine.placements.get(t)
        shape = where.full_shape if where is not None else tuple(t.shape)
        found = self.engine._where.get(id(t))
        dtype = found[0].master.dtype if found is not None else t.dtype
        if self.dtype is not None and dtype.is_floating_point:
            dtype = self.dtype
        return TensorSpec(name, tuple(shape), dtype)

    def spec(self, name: str) -> TensorSpec:
        return self.items[name].spec

    def fetch(self, name: str) -> torch.Tensor | None:
        """The whole tensor ``name`` on the writer (None elsewhere); call on every rank.
        Communicates: on the owning stage, the ZeRO and tp gathers of it; with a pipeline,
        one send from the owner to the writer along the writer's pp line."""
        item = self.items[name]
        value = None
        if item.owner == self.pp_rank:
            value = self.held.track(self._gather_local(name))
        if item.owner != 0 and self.writer_line and self.pp_group is not None:
            src = self.pp_group.ranks[item.owner]
            if self.pp_rank == item.owner:
                assert value is not None
                ops.send(value.contiguous(), self.pp_group.ranks[0], group=self.pp_group)
                value = None
            elif self.pp_rank == 0:
                value = self.held.track(torch.empty(item.spec.shape, dtype=item.spec.dtype))
                ops.recv(value, src, group=self.pp_group)
        return value if self.is_writer else None

    def _gather_local(self, name: str) -> torch.Tensor:
        t = self.local[name]
        spec = self.items[name].spec
        found = self.engine._where.get(id(t))
        value = gather_param_master(*found) if found is not None else t.detach()
        where = self.engine.placements.get(t)
        if where is not None and where.shards:
            value = where.gather_full(value, self.engine.placements.group)
        return value.to("cpu", spec.dtype)


def _local_tensors(
    module: nn.Module, pipe: PipelineModule | None, names: Mapping[str, str] | None
) -> dict[str, torch.Tensor]:
    """This rank's state-dict tensors under the output names: each tensor once (its first
    name), a tied pipeline copy only on its first holder, pipeline names mapped to the plain
    model's."""
    rename = dict(names) if names is not None else (pipe.plain_names if pipe else {})
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen or (pipe is not None and pipe.is_tied_copy(name)):
            continue
        seen.add(id(t))
        if pipe is not None and name not in rename:
            raise ValueError(
                f"pipeline tensor {name!r} has no name in the plain model: build the pipeline "
                "with shardwise.parallelize (which records the names) or pass names= "
                "{pipeline name: plain model name}"
            )
        out[rename.get(name, name)] = t
    return out


def save_pretrained(
    engine: ExportableEngine,
    out_dir: Path | str,
    max_shard_size: int | str = "5GB",
    *,
    config: ConfigLike | None = None,
    generation_config: ConfigLike | None = None,
    tokenizer_dir: Path | str | None = None,
    adapter_only: bool = False,
    merge: bool = False,
    adapter_name: str = "default",
    names: Mapping[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> ExportReport:
    """See ``Engine.save_pretrained``."""
    if adapter_only and merge:
        raise ValueError("adapter_only and merge exclude each other: pick one")
    module = engine.module
    peft_config = _peft_config(module, adapter_name) if (adapter_only or merge) else None
    ex = _Exporter(engine, names, dtype)
    out = Path(out_dir)
    if adapter_only:
        assert peft_config is not None
        chosen = {k: n for n in ex.items if (k := adapter_key(n, adapter_name)) is not None}
        if not chosen:
            raise ValueError(f"the model has no LoRA tensors of adapter {adapter_name!r}")
        specs = [ex.spec(n)._replace(name=k) for k, n in chosen.items()]
        check_lora_config(peft_config)  # on every rank: a bad config fails everywhere at once

        def write_adapter(produce: Producer) -> None:
            write_adapter_dir(out, specs, produce, peft_config)

        return _run(ex, out, list(chosen), lambda k: ex.fetch(chosen[k]), write_adapter)
    produce: Callable[[str], torch.Tensor | None] = ex.fetch
    specs = [it.spec for it in ex.items.values()]
    source = _base_model(module) if merge else (module if ex.pipe is None else None)
    if merge:
        assert peft_config is not None
        produce, specs = _merged(ex, peft_config, adapter_name)
    if config is None:
        config = getattr(source, "config", None)
    if generation_config is None:
        generation_config = getattr(source, "generation_config", None)
    _check_side_files(config, generation_config, tokenizer_dir)
    if config is None and ex.is_writer:
        log.warning(
            "exporting to %s without a config.json (the model has no .config): pass "
            "save_pretrained(config=...) for a directory from_pretrained can load",
            out,
        )
    order = list(plan_shards(specs, max_shard_size).weight_map)

    def write_model(produce: Producer) -> None:
        write_model_dir(
            out,
            specs,
            produce,
            max_shard_size,
            config=config,
            generation_config=generation_config,
            tokenizer_dir=tokenizer_dir,
        )

    return _run(ex, out, order, produce, write_model)


def _check_side_files(
    config: ConfigLike | None, generation: ConfigLike | None, tokenizer_dir: Path | str | None
) -> None:
    """What ``write_model_dir`` checks before writing, run on every rank first, so a bad
    config fails on all ranks together instead of leaving them waiting on the writer."""
    if config is not None:
        json_bytes(config_dict(config, CONFIG_NAME))
    if generation is not None:
        json_bytes(config_dict(generation, GENERATION_CONFIG_NAME))
    if tokenizer_dir is not None:
        tokenizer_file_names(tokenizer_dir)


def _peft_config(module: nn.Module, adapter_name: str) -> Any:
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or adapter_name not in configs:
        raise ValueError(
            f"adapter_only / merge need a peft model with adapter {adapter_name!r} as the "
            f"engine's model; {type(module).__name__} has "
            f"{sorted(configs) if isinstance(configs, dict) else 'no peft adapters'}"
        )
    return configs[adapter_name]


def _base_model(module: nn.Module) -> Any:
    get = getattr(module, "get_base_model", None)
    return get() if callable(get) else module


def _merged(
    ex: _Exporter, peft_config: Any, adapter_name: str
) -> tuple[Callable[[str], torch.Tensor | None], list[TensorSpec]]:
    """The merged model's tensors and their producer: a base weight with its LoRA pair folded
    in (A and B gathered after it), every other base tensor as it is."""
    plan = lora_merge_plan(list(ex.items), peft_config, adapter_name)
    specs = [ex.spec(src)._replace(name=name) for name, (src, _) in plan.items()]

    def produce(name: str) -> torch.Tensor | None:
        src, delta = plan[name]
        weight = ex.fetch(src)
        if delta is None:
            return weight
        a, b = ex.fetch(delta.lora_a), ex.fetch(delta.lora_b)
        if weight is None or a is None or b is None:
            return None
        return ex.held.track(merge_lora(name, weight, a, b, delta))

    return produce, specs


Producer = Callable[[str], Any]


def _run(
    ex: _Exporter,
    out: Path,
    order: list[str],
    produce: Callable[[str], torch.Tensor | None],
    write: Callable[[Producer], None],
) -> ExportReport:
    """The writer writes (asking ``produce`` in ``order``); every other rank joins the same
    gathers in the same order. Then every rank learns the writer's outcome (one
    broadcast_object over every rank), so all raise or all return together."""
    everyone = ex.everyone
    error: str | None = None
    if ex.is_writer:
        try:
            write(produce)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            objects.broadcast_object(error, src=everyone.ranks[0], group=everyone)
    else:
        for name in order:
            produce(name)
        error = objects.broadcast_object(None, src=everyone.ranks[0], group=everyone)
        if error is not None:
            raise RuntimeError(f"the export to {out} failed on the writing rank: {error}")
    log.info("exported %d tensors to %s", len(order), out)
    return ExportReport(out, order, ex.held.peak)

"""The model of a ``shardwise train`` rank with the run's parallelism applied from outside, in
the style guide's order: the process mesh (pp x dp x tp), the pipeline split
(``GPT.pipeline_layers`` into a ``PipelineModule``), tensor parallelism over the tp axis. ZeRO
over dp comes after, in ``shardwise.initialize``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import World
from shardwise.mesh import Mesh
from shardwise.models.gpt import GPT, tp_plan
from shardwise.parallel import tensor as swtp
from shardwise.parallel.pipeline import LayerFn, LayerSpec, PipelineModule, Tied
from shardwise.seeding import seed_all
from shardwise.train.options import RunConfig

PIPELINE_LAYERS_AROUND_BLOCKS = 4
"""``GPT.pipeline_layers()`` entries besides the blocks: token embedding, positions, final norm
and the tied head."""


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's mean cross entropy on the last stage's logits [batch, seq, vocab]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class BuiltModel:
    """A rank's model and how its parameter names map to the plain ``GPT``'s."""

    module: nn.Module
    """The ``GPT`` (tp-split under ``--tp``) or this pp rank's ``PipelineModule``."""
    gpt_names: dict[str, str] = field(default_factory=dict)
    """Pipeline only: ``PipelineModule`` parameter name -> the plain GPT's name."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Pipeline only: GPT state-dict names that repeat another tensor (the tied head)."""

    @property
    def pipeline(self) -> bool:
        return isinstance(self.module, PipelineModule)

    def gpt_state(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The plain GPT's state dict from every pp rank's ``{GPT name: tensor}``; tied aliases
        as copies of the tensor they repeat."""
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            state.update(part)
        for alias, first in self.aliases.items():
            state[alias] = state[first].clone()
        return state


def build_mesh(run: RunConfig, world: World) -> Mesh:
    """The run's mesh: ``--tp`` and ``--pp`` as given, dp filling the rest of the world (split
    into ``--dp-replicate`` replicas). Every rank calls it (groups form collectively)."""
    r = run.train.dp_replicate
    replicate = r if r > 1 else None
    return Mesh(dp=-1, tp=run.train.tp, pp=run.train.pp, dp_replicate=replicate, world=world)


def build_model(run: RunConfig, mesh: Mesh) -> BuiltModel:
    """``GPT`` seeded with the run's seed (the same weights on every rank); under ``--pp`` only
    this rank's stages of it (``partition="parameters"``), under ``--tp`` split by
    ``tp_plan()`` (its loss then the vocab-parallel cross entropy of the split head).
    Communicates: under ``--pp``, the ``PipelineModule``'s tied-group setup."""
    seed_all(run.engine.seed)
    model = GPT(run.model)
    if mesh.pp_size > 1:
        return _pipeline(model, run, mesh)
    if mesh.tp_size > 1:
        swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=run.train.sequence_parallel)
    return BuiltModel(model)


def _split_head(model: GPT) -> tuple[Tied, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Under tensor parallelism, the last pipeline layer and the loss: the GPT's own split head
    (its weight is the tied token embedding's shard; it brings its input into the tp region,
    all_reduce of its gradient in backward) and the vocab-parallel cross entropy on the
    vocab-split logits it returns."""
    head = model.head
    assert isinstance(head, swtp.ColumnParallelLinear)

    def forward(emb: nn.Module, h: torch.Tensor) -> torch.Tensor:
        assert head.weight is getattr(emb, "weight", None)  # the tied weight, one Parameter
        return head(h)  # [batch, seq, vocab // tp_size]

    return Tied("tok_emb", model.tok_emb, forward_fn=forward), head.cross_entropy


def _sequence_positions(model: GPT, tp_size: int) -> LayerFn:
    """The positions layer under sequence parallelism: its input holds 1/tp of the sequence,
    the position embedding (a ``sequence`` module) takes the whole sequence's positions and
    keeps this rank's slice of them."""

    def add_positions(layer: Any, x: torch.Tensor) -> torch.Tensor:  # x: [batch, seq // tp, d]
        pos = torch.arange(x.shape[1] * tp_size, device=x.device)
        return layer.drop(x + layer.pos_emb(pos))

    return LayerFn(add_positions, pos_emb=model.pos_emb, drop=model.drop)


def pipeline_names(model: GPT) -> dict[str, str]:
    """``PipelineModule`` parameter names of ``model.pipeline_layers()`` (``layers.{i}.*`` by
    index, ``tied.{key}.*``; a pipeline checkpoint's names) -> the plain GPT's names."""
    gpt_name = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, str] = {}
    for i, entry in enumerate(model.pipeline_layers()):
        prefix, module = (
            (f"tied.{entry.key}", entry.source)
            if isinstance(entry, Tied)
            else (f"layers.{i}", entry)
        )
        assert isinstance(module, nn.Module)
        out.update({f"{prefix}.{n}": gpt_name[id(p)] for n, p in module.named_parameters()})
    return out


def state_aliases(model: GPT) -> dict[str, str]:
    """State-dict names of ``model`` that repeat another entry's tensor (the tied head) -> it."""
    first: dict[int, str] = {}
    aliases = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if first.setdefault(id(t), name) != name:
            aliases[name] = first[id(t)]
    return aliases


def _pipeline(model: GPT, run: RunConfig, mesh: Mesh) -> BuiltModel:
    names, aliases = pipeline_names(model), state_aliases(model)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gpt_loss
    if mesh.tp_size > 1:
        # tensor parallelism goes onto the whole GPT, before the split: its plan names the
        # GPT's modules, and the split head exists only there (the pipeline layers are the
        # same module objects, so every stage holds tp-split layers); it communicates nothing
        swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=run.train.sequence_parallel)
    layers = cast("list[nn.Module | LayerSpec | Tied]", model.pipeline_layers())
    if mesh.tp_size > 1:
        layers[-1], loss_fn = _split_head(model)
    if mesh.tp_size > 1 and run.train.sequence_parallel:
        layers[1] = _sequence_positions(model, mesh.tp_size)
    pipe = PipelineModule(
        layers,
        loss_fn,
        mesh,
        partition="parameters",
        virtual_stages=run.engine.pipeline_virtual_stages,
    )
    return BuiltModel(pipe, names, aliases)

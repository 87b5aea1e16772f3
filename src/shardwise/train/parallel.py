"""The model of a ``shardwise train`` rank: the process mesh (pp x dp x tp) and the built-in
GPT with the library's own recipe applied (``shardwise.parallel.plans.gpt``: pipeline split,
tensor and sequence parallelism). ZeRO over dp comes after, in ``shardwise.initialize``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardwise.comm import World
from shardwise.deferred import deferred_init
from shardwise.mesh import Mesh
from shardwise.models.gpt import GPT
from shardwise.parallel import plans
from shardwise.parallel.parallelize import Parallelized, parallelize, pipeline_names
from shardwise.parallel.pipeline import PipelineModule
from shardwise.seeding import seed_all
from shardwise.train.options import RunConfig

PIPELINE_LAYERS_AROUND_BLOCKS = 4
"""``plans.gpt.pipeline_layers()`` entries besides the blocks: token embedding, positions,
final norm and the tied head."""


@dataclass
class BuiltModel:
    """A rank's parallelized model and how its parameter names map to the plain ``GPT``'s."""

    parallelized: Parallelized
    """The ``GPT`` (tp-split under ``--tp``) or this pp rank's ``PipelineModule``."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Pipeline only: GPT state-dict names that repeat another tensor (the tied head)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """Under ``--cp``: the loss on this rank's logits over every cp rank's tokens."""

    def split(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of a batch ([batch, seq] -> [batch, seq / cp]) under ``--cp``
        (every cp rank reads the same batch), else the batch."""
        context = self.parallelized.context
        if context is None:
            return x, y
        xs, ys = context.split(x, y)
        return xs, ys

    def forward_loss(
        self, engine: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """The mean loss of a batch through ``engine`` (the model's forward): under ``--cp``
        over every cp rank's tokens (the same value on each), else the model's own loss."""
        if self.loss is None:
            return engine(x, y)
        xs, ys = self.split(x, y)
        return self.loss(engine(xs), ys)

    @property
    def module(self) -> torch.nn.Module:
        return self.parallelized.module

    @property
    def gpt_names(self) -> dict[str, str]:
        """Pipeline only: ``PipelineModule`` parameter name -> the plain GPT's name."""
        return dict(self.parallelized.names)

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
    """The run's mesh: ``--tp``, ``--pp`` and ``--cp`` as given, dp filling the rest of the
    world (split into ``--dp-replicate`` replicas). Every rank calls it (groups form
    collectively)."""
    r = run.train.dp_replicate
    replicate = r if r > 1 else None
    t = run.train
    return Mesh(dp=-1, tp=t.tp, pp=t.pp, cp=t.cp, dp_replicate=replicate, world=world)


def build_model(run: RunConfig, mesh: Mesh) -> BuiltModel:
    """``GPT`` seeded with the run's seed (the same weights on every rank) with the GPT recipe
    applied: under ``--pp`` only this rank's stages of it (balanced by parameters; the GPT is
    built on the meta device and only this rank's stages are ever allocated, initialized as
    the whole GPT would be), under
    ``--tp`` split by the GPT's tensor-parallel plan (its loss then the vocab-parallel cross
    entropy). Communicates: under ``--pp``, the ``PipelineModule``'s tied-group setup."""
    seed_all(run.engine.seed)
    with deferred_init() if mesh.pp_size > 1 else contextlib.nullcontext():
        model = GPT(run.model)
    plan = plans.gpt.plan(
        run.model,
        mesh,
        sequence_parallel=run.train.sequence_parallel,
        virtual_stages=run.engine.pipeline_virtual_stages or 1,
        cp_method=run.train.cp_method,
    )
    aliases = state_aliases(model) if mesh.pp_size > 1 else {}
    loss = plans.gpt.loss(run.model, mesh) if mesh.cp_size > 1 else None
    return BuiltModel(parallelize(model, mesh, plan), aliases, loss)


def gpt_pipeline_names(model: GPT) -> dict[str, str]:
    """``PipelineModule`` parameter names of the GPT recipe's pipeline layers (a pipeline
    checkpoint's names) -> the plain GPT's names."""
    return pipeline_names(model, plans.gpt.pipeline_layers(model))


def state_aliases(model: GPT) -> dict[str, str]:
    """State-dict names of ``model`` that repeat another entry's tensor (the tied head) -> it."""
    first: dict[int, str] = {}
    aliases = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if first.setdefault(id(t), name) != name:
            aliases[name] = first[id(t)]
    return aliases

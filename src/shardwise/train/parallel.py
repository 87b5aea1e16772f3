"""The model of a ``shardwise train`` rank with the run's parallelism applied from outside:
the process mesh (pp x dp x tp), then tensor parallelism over its tp axis. ZeRO over dp comes
after, in ``shardwise.initialize``."""

from __future__ import annotations

from torch import nn

from shardwise import tp as swtp
from shardwise.comm import World
from shardwise.mesh import Mesh
from shardwise.models.gpt import GPT, tp_plan
from shardwise.seeding import seed_all
from shardwise.train.options import RunConfig


def build_mesh(run: RunConfig, world: World) -> Mesh:
    """The run's mesh: ``--tp`` and ``--pp`` as given, dp filling the rest of the world.
    Every rank calls it (groups form collectively)."""
    return Mesh(dp=-1, tp=run.train.tp, pp=run.train.pp, world=world)


def build_model(run: RunConfig, mesh: Mesh) -> nn.Module:
    """``GPT`` seeded with the run's seed (the same weights on every rank), split over the
    mesh's tp axis by ``tp_plan()`` when ``--tp`` > 1; its loss is then the vocab-parallel
    cross entropy of the split head. Communicates nothing."""
    seed_all(run.engine.seed)
    model = GPT(run.model)
    if mesh.tp_size > 1:
        swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=run.train.sequence_parallel)
    return model

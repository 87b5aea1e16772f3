"""Which ranks save and load an engine checkpoint together, and what they agree on before a
save or a load: the saving group (the whole mesh, pipeline stages included), every stage's
scalar optimizer states merged, and the stored names and shapes of the whole model."""

from __future__ import annotations

from shardwise import dist as sw_dist
from shardwise.comm import objects
from shardwise.comm.groups import Group
from shardwise.engine.run_state import CheckpointableEngine
from shardwise.mesh import AXIS_ORDER, Axis
from shardwise.zero.checkpoint_entries import ModelNames, ScalarStates, expected_entries
from shardwise.zero.param_layout import ParamLayout


def save_group(engine: CheckpointableEngine) -> Group:
    """The ranks that save and load a checkpoint together: the engine's whole mesh
    (pp x dp x tp), or its data-parallel group. Raises ValueError unless that is the world in
    rank order."""
    mesh = engine.mesh
    group = engine.group if mesh is None else mesh.group(*AXIS_ORDER)
    world = sw_dist.world_size()
    if tuple(group.ranks) != tuple(range(world)):
        raise ValueError(
            f"checkpoints need the engine's mesh or data-parallel group to be the whole "
            f"world in rank order; it is {group} of {world} ranks"
        )
    return group


def gather_scalars(engine: CheckpointableEngine, local: ScalarStates) -> ScalarStates:
    """Every rank's scalar optimizer states (every stage's), merged; pieces of one parameter
    must agree. Communicates: one all_gather_object over the saving group."""
    merged: ScalarStates = {}
    for rank, states in enumerate(objects.all_gather_object(local, group=save_group(engine))):
        for name, values in states.items():
            if merged.setdefault(name, values) != values:
                raise ValueError(
                    f"scalar optimizer states of {name!r} differ between ranks "
                    f"({merged[name]} vs rank {rank}'s {values})"
                )
    return merged


def whole_model_entries(
    engine: CheckpointableEngine, names: ModelNames, layouts: dict[int, ParamLayout]
) -> dict[str, tuple[int, ...]]:
    """Stored names and shapes of the whole model: every pipeline stage's. Communicates (pp >
    1): one all_gather_object over the pp group."""
    mine = expected_entries(engine.module, names, layouts)
    if engine.mesh is None or engine.mesh.pp_size == 1:
        return mine
    merged: dict[str, tuple[int, ...]] = {}
    for stage in objects.all_gather_object(mine, group=engine.mesh.group(Axis.PP)):
        merged.update(stage)
    return merged

"""What the ranks that save and load an engine checkpoint together (``CheckpointState.save_group``:
the engine's whole mesh, pipeline stages included, or its data-parallel group; a sub-world's
engine on its own) agree on before a save or a load: every stage's scalar optimizer states
merged, and the stored names and shapes of the whole model."""

from __future__ import annotations

from shardwise.comm import objects
from shardwise.engine.run_state import CheckpointState
from shardwise.zero.checkpoint_entries import ModelNames, ScalarStates, expected_entries
from shardwise.zero.param_layout import ParamLayout


def gather_scalars(engine: CheckpointState, local: ScalarStates) -> ScalarStates:
    """Every rank's scalar optimizer states (every stage's), merged; pieces of one parameter
    must agree. Communicates: one all_gather_object over the saving group."""
    merged: ScalarStates = {}
    for rank, states in enumerate(objects.all_gather_object(local, group=engine.save_group)):
        for name, values in states.items():
            if merged.setdefault(name, values) != values:
                raise ValueError(
                    f"scalar optimizer states of {name!r} differ between ranks "
                    f"({merged[name]} vs rank {rank}'s {values})"
                )
    return merged


def whole_model_entries(
    engine: CheckpointState,
    names: ModelNames,
    layouts: dict[int, ParamLayout],
    frozen: bool = True,
) -> dict[str, tuple[int, ...]]:
    """Stored names and shapes of the whole model: every pipeline stage's (``frozen=False``:
    without frozen parameters). Communicates (pp > 1): one all_gather_object over the pp
    group."""
    mine = expected_entries(engine.module, names, layouts, frozen)
    if engine.pp_group is None:
        return mine
    merged: dict[str, tuple[int, ...]] = {}
    for stage in objects.all_gather_object(mine, group=engine.pp_group):
        merged.update(stage)
    return merged

"""Rank functions for an engine on a sub-world: two of four ranks train, save and load their
own checkpoint while the other two do their own collectives."""

from __future__ import annotations

from pathlib import Path

import torch
import zero_cases as zc

import shardwise
from shardwise import comm
from shardwise.checkpoint import CheckpointReader
from shardwise.comm import Group, ops

PARTS = 4  # micro-batches of each global batch


def _engine(stage: int, on: Group | shardwise.Mesh, root: Path) -> shardwise.Engine:
    torch.manual_seed(0)
    model = zc.make_gpt()
    cfg = shardwise.Config(
        zero_stage=stage, reduce_bucket_bytes=4096, gradient_accumulation_steps=PARTS // 2,
        checkpoint_dir=str(root),
    )
    return shardwise.initialize(model, zc.make_optimizer(model, "adamw"), cfg, group=on)


def _train(engine: shardwise.Engine, group: Group, start: int, stop: int) -> list[float]:
    accum = PARTS // group.size
    batches = zc.batches("gpt", stop, PARTS)
    losses = []
    for s in range(start, stop):
        total = torch.zeros(())
        for a in range(accum):
            x, y = batches[s][group.rank * accum + a]
            loss = engine(x, y)
            engine.backward(loss)
            total += loss.detach() / PARTS
        assert engine.step()
        ops.all_reduce(total, group=group)
        losses.append(total.item())
    return losses


def train_save_load_on_half(root: str, stage: int, use_mesh: bool) -> dict[str, object]:
    """Ranks 0-1 train 2 steps over their own group (or a 2 x 1 mesh of it), save, train a
    third; a fresh engine loads the save and takes the third step again. Ranks 2-3 meanwhile
    all_reduce over their own group."""
    world = comm.current()
    halves = [world.new_group([0, 1], name="half0"), world.new_group([2, 3], name="half1")]
    meshes = [shardwise.Mesh(dp=2, tp=1, world=h) for h in halves] if use_mesh else None
    mine = halves[world.rank // 2]
    if world.rank >= 2:  # something else entirely, on their own group
        t = torch.full((3,), float(world.rank))
        for _ in range(3):
            ops.all_reduce(t, group=mine)
        return {"other": t.tolist()}
    on: Group | shardwise.Mesh = meshes[0] if meshes is not None else mine
    engine = _engine(stage, on, Path(root))
    first = _train(engine, mine, 0, 2)
    saved = engine.save()
    third = _train(engine, mine, 2, 3)
    fresh = _engine(stage, on, Path(root))
    fresh.load(saved)
    again = _train(fresh, mine, 2, 3)
    with CheckpointReader(saved) as reader:
        recorded = (reader.trainer_state["world_size"], reader.world_size)
    return {"first": first, "third": third, "again": again, "recorded": recorded,
            "step": fresh.global_step}

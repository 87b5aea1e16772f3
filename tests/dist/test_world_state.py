"""State is a value: two meshes, each with its own engine, share one process without touching
each other's counters, numbers or debug setting, and building an engine changes nothing
process-wide."""

from __future__ import annotations

import random

import numpy as np
import torch
import zero_cases as zc

import shardwise
from shardwise.comm import World, current
from shardwise.testing import run_on_ranks

STEPS = 2
# A: ZeRO-2 over all four ranks, with the desync check; B: ZeRO-3 over dp=2 of a 2 x 2 mesh.
SETUPS = {
    "a": ({"dp": 4}, {"zero_stage": 2, "debug_collectives": True}),
    "b": ({"dp": 2, "tp": 2}, {"zero_stage": 3}),
}


def _rng_state() -> tuple:
    return (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())


def _build(world: World, which: str) -> tuple[shardwise.Mesh, shardwise.Engine]:
    sizes, cfg = SETUPS[which]
    mesh = shardwise.Mesh(world=world, **sizes)
    model = zc.make_gpt()
    opt = zc.make_optimizer(model, "adamw")
    before = _rng_state()
    engine = shardwise.initialize(model, opt, shardwise.Config(**cfg), group=mesh)
    after = _rng_state()
    assert before[0] == after[0] and before[1] == after[1], "initialize reseeded an RNG"
    assert torch.equal(before[2], after[2]), "initialize reseeded torch's RNG"
    return mesh, engine


def _step(mesh: shardwise.Mesh, engine: shardwise.Engine, parts: list) -> float:
    dp = mesh.group("dp")
    x, y = parts[dp.rank]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _counts(stats: dict) -> dict:
    return {op: (s["calls"], s["bytes"]) for op, s in stats.items()}


def _run(which: tuple[str, ...]) -> dict:
    torch.set_num_threads(1)
    world = current()
    built = {w: _build(world, w) for w in which}
    losses: dict[str, list[float]] = {w: [] for w in which}
    for s in range(STEPS):
        for w, (mesh, engine) in built.items():  # interleaved step by step
            parts = zc.batches("gpt", STEPS, mesh.dp_size)[s]
            losses[w].append(_step(mesh, engine, parts))
    out: dict = {w: {"stats": _counts(mesh.stats.snapshot())} for w, (mesh, _) in built.items()}
    out["world"] = _counts(world.stats.snapshot())
    out["world_debug"] = (world.debug, world.debug_enabled())
    for w, (_, engine) in built.items():  # state_dict communicates: after the counts
        out[w].update(
            losses=losses[w], state=engine.state_dict(), debug=engine.group.debug_enabled()
        )
    return out


def test_two_meshes_and_engines_do_not_interfere():
    alone_a = run_on_ranks(4, _run, ("a",))
    alone_b = run_on_ranks(4, _run, ("b",))
    both = run_on_ranks(4, _run, ("a", "b"))
    for r in range(4):
        for w, alone in (("a", alone_a[r]), ("b", alone_b[r])):
            got, want = both[r][w], alone[w]
            assert got["stats"] == want["stats"], (r, w)
            assert got["losses"] == want["losses"], (r, w)
            for k, v in want["state"].items():
                assert torch.equal(got["state"][k], v), (r, w, k)
            assert alone["world"] == alone[w]["stats"]  # a mesh's ops count in its world too
        # the world's totals are the sum of the two meshes'
        ops = set(both[r]["a"]["stats"]) | set(both[r]["b"]["stats"])
        summed = {
            op: tuple(
                sum(both[r][w]["stats"].get(op, (0, 0))[i] for w in ("a", "b")) for i in (0, 1)
            )
            for op in ops
        }
        assert both[r]["world"] == summed
        # the desync check is a property of engine A's group, nothing process-wide
        assert both[r]["a"]["debug"] is True and both[r]["b"]["debug"] is False
        assert both[r]["world_debug"] == (None, False)
    # the meshes really differ: B reduces over 2 ranks, A over 4
    assert alone_a[0]["a"]["stats"] != alone_b[0]["b"]["stats"]

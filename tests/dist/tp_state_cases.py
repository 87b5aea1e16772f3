"""Rank-side bodies of the tests of a tensor-parallel engine's full state: ``state_dict()`` is
the single-process model's (padding cut), loads into a plain model, and ``load_state_dict``
keeps each rank's piece."""

from __future__ import annotations

import torch
import tp_cases as tc

import shardwise
from shardwise.parallel import tensor as swtp
from shardwise.mesh import Mesh
from shardwise.models.gpt import GPT
from shardwise.parallel.plans.gpt import tp_plan

VOCAB = 37  # not divisible by tp: the embedding and head are padded


def global_batches(steps: int, dp: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches at every dp size: ``dp`` parts of ``tc.batches`` each."""
    parts = [tc.batches(steps, VOCAB, ignore=False, seed=seed + s) for s in range(2)]
    return [
        (torch.cat([p[i][0] for p in parts]), torch.cat([p[i][1] for p in parts]))
        for i in range(steps)
    ]


def tp_engine(dp: int, tp_size: int, stage: int, seed: int = 0, **config) -> shardwise.Engine:
    """A GPT built with ``seed``, split over tp, ZeRO ``stage`` over dp (AdamW, clipping)."""
    mesh = Mesh(dp=dp, tp=tp_size)
    torch.manual_seed(seed)
    model = GPT(tc.gpt_config(vocab=VOCAB))
    placements = None
    if tp_size > 1:
        placements = swtp.parallelize(model, mesh, tp_plan()).placements
    cfg = shardwise.Config(
        zero_stage=stage, gradient_clipping=0.05, reduce_bucket_bytes=4096, **config
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    return shardwise.initialize(model, opt, cfg, group=mesh, placements=placements)


def train(engine: shardwise.Engine, data: list, dp: int, dp_rank: int) -> list[float]:
    """One optimizer step per global batch, this rank on its dp part; the global losses."""
    losses = []
    for x, y in data:
        loss = engine(x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float() / dp
        shardwise.comm.all_reduce(total, group=engine.group)
        losses.append(total.item())
    return losses


def reference(steps: int, seed: int = 0) -> tuple[torch.nn.Module, list[float]]:
    torch.manual_seed(seed)
    ref = GPT(tc.gpt_config(vocab=VOCAB))
    losses, _ = tc._ref_steps(ref, global_batches(steps, 2), 0.05)
    return ref, losses


def _same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].shape == want[k].shape, f"{what}: {k} {got[k].shape} vs {want[k].shape}"
        torch.testing.assert_close(
            got[k], want[k], rtol=tc.RTOL, atol=tc.ATOL, msg=lambda m, k=k: f"{what}: {k}: {m}"
        )


def state_dict_round_trip(dp: int, tp_size: int, stage: int) -> dict:
    """Train 3 steps; the full state equals one process's, loads strictly into a plain GPT,
    and a fresh engine at the same layout that loads it holds each rank's piece of it."""
    ref, ref_losses = reference(3)
    engine = tp_engine(dp, tp_size, stage)
    mesh = engine.mesh
    losses = train(engine, global_batches(3, 2), dp, mesh.rank("dp"))
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=tc.RTOL, atol=tc.ATOL
    )
    full = engine.state_dict()
    _same(full, ref.state_dict(), "engine.state_dict()")
    plain = GPT(tc.gpt_config(vocab=VOCAB))
    plain.load_state_dict(full, strict=True)
    x, y = global_batches(1, 2, seed=7)[0]
    torch.testing.assert_close(plain(x, y), ref(x, y), rtol=tc.RTOL, atol=tc.ATOL)

    fresh = tp_engine(dp, tp_size, stage, seed=5)
    fresh.load_state_dict(ref.state_dict())
    _same(fresh.state_dict(), ref.state_dict(), "after load_state_dict")
    with fresh.gathered_parameters():
        for name, p in fresh.module.named_parameters():
            where = fresh.placement(p)
            piece = where.shard_of(ref.state_dict()[name])
            assert torch.equal(p.detach(), piece), f"{name}: not this rank's piece"
    loss = fresh(x.chunk(dp)[mesh.rank("dp")], y.chunk(dp)[mesh.rank("dp")]).detach() / dp
    shardwise.comm.all_reduce(loss, group=fresh.group)
    torch.testing.assert_close(loss, ref(x, y).detach(), rtol=tc.RTOL, atol=tc.ATOL)
    return {"coords": mesh.coords}


# ---- checkpoints across (dp, tp) layouts ----

SAVED_AT = 2  # optimizer steps before the save
MORE = 2  # steps after it


def save_at(root: str, dp: int, tp_size: int, stage: int) -> list[float]:
    """Train ``SAVED_AT`` steps at dp x tp and save; the global losses."""
    engine = tp_engine(dp, tp_size, stage)
    data = global_batches(SAVED_AT + MORE, 2)[:SAVED_AT]
    losses = train(engine, data, dp, engine.mesh.rank("dp"))
    engine.save(root)
    return losses


def load_and_continue(root: str, dp: int, tp_size: int, stage: int, saved_tp: int = 2) -> dict:
    """A fresh engine at dp x tp (other initial weights) loads the checkpoint (saved at tp
    ``saved_tp``) and trains ``MORE`` steps: the losses and the full state after them."""
    engine = tp_engine(dp, tp_size, stage, seed=5)
    state = engine.load(root)
    assert engine.global_step == SAVED_AT and state["tp_size"] == saved_tp, state["tp_size"]
    data = global_batches(SAVED_AT + MORE, 2)[SAVED_AT:]
    losses = train(engine, data, dp, engine.mesh.rank("dp"))
    return {"losses": losses, "state": engine.state_dict()}


def load_damaged(root: str, file: str) -> str:
    """A copy of the checkpoint with one byte of ``file`` flipped is refused on load at tp4;
    the message."""
    from pathlib import Path

    from shardwise.checkpoint import CheckpointError

    copy_root = f"{root}-flip"
    if shardwise.rank() == 0:
        import shutil

        shutil.copytree(root, copy_root)
        target = Path(copy_root) / f"step-{SAVED_AT:08d}" / file
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    shardwise.comm.barrier()
    engine = tp_engine(1, 4, 0, seed=5)
    try:
        engine.load(copy_root)
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("a damaged checkpoint was loaded")


def load_message(root: str, dp: int, tp_size: int, stage: int) -> str:
    """The line the load logs: who saved the checkpoint and who loads it."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("shardwise")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        tp_engine(dp, tp_size, stage, seed=5).load(root)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return next(m for m in records if "loaded step" in m)

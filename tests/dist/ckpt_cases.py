"""Rank functions of the engine checkpoint tests: train, save, load at another size, continue.

A global batch is always ``PARTS`` micro-batches of ``zero_cases.batches``, so every world size
sees the same global batches: rank r takes parts ``[r * accum, (r + 1) * accum)`` with
``accum = PARTS // world`` micro-steps per optimizer step, and the single-process reference
``zero_cases.reference(..., PARTS, steps, 1, ...)`` trains on exactly the same data.
"""

from __future__ import annotations

import collections
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import zero_cases as zc

import shardwise
from shardwise import comm
from shardwise.checkpoint import CheckpointError
from shardwise.data.sampler import DistributedBatchSampler

PARTS = 12  # divisible by world sizes 1, 2, 3 and 4


def make_engine(stage: int, opt: str = "adamw", frozen: bool = False, **config: Any
                ) -> shardwise.Engine:
    torch.set_num_threads(1)
    model = zc.make_gpt()
    if frozen:
        zc.freeze_first_layer(model)
    cfg = shardwise.Config(zero_stage=stage, reduce_bucket_bytes=4096,
                           gradient_accumulation_steps=PARTS // shardwise.world_size(), **config)
    return shardwise.initialize(model, zc.make_optimizer(model, opt), cfg)


def train(engine: shardwise.Engine, start: int, stop: int) -> list[float]:
    """Optimizer steps ``start..stop-1`` on the shared global batches; the global losses."""
    world, rank = shardwise.world_size(), shardwise.rank()
    accum = PARTS // world
    batches = zc.batches("gpt", stop, PARTS)
    losses = []
    for s in range(start, stop):
        total = torch.zeros(())
        for a in range(accum):
            x, y = batches[s][rank * accum + a]
            loss = engine(x, y)
            engine.backward(loss)
            total += loss.detach() / PARTS
        assert engine.step()
        engine.maybe_save()
        shardwise.all_reduce(total)
        losses.append(total.item())
    return losses


# ---- resharding ----

def save_phase(stage: int, opt: str, frozen: bool, root: str, steps: int) -> list[float]:
    engine = make_engine(stage, opt, frozen)
    losses = train(engine, 0, steps)
    engine.save(root)
    return losses


def load_phase(stage: int, opt: str, frozen: bool, root: str, steps: int
               ) -> tuple[list[float], dict[str, torch.Tensor], int]:
    engine = make_engine(stage, opt, frozen)
    engine.load(root)
    start = engine.global_step
    losses = train(engine, start, steps)
    return losses, engine.state_dict(), start


# ---- same world size: bitwise ----

def _sampler_run(stage: int, root: str, steps: int, save_at: int | None, load: bool,
                 ) -> tuple[dict[str, torch.Tensor], list[float], float]:
    torch.set_num_threads(1)
    world, rank = shardwise.world_size(), shardwise.rank()
    model = zc.make_gpt()
    cfg = shardwise.Config(zero_stage=stage, reduce_bucket_bytes=4096, checkpoint_dir=root)
    engine = shardwise.initialize(
        model, zc.make_optimizer(model, "adamw_groups"), cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [1, 3, 3], gamma=0.5))
    tokens = torch.randint(0, zc.GPT_CFG.vocab_size, (4096,),
                           generator=torch.Generator().manual_seed(3))
    sampler = DistributedBatchSampler(tokens, zc.GPT_CFG.seq_len, 2, rank, world, seed=5)
    if load:
        engine.load(sampler=sampler)
    losses = []
    while engine.global_step < steps:
        loss = engine(*sampler.next_batch())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.global_step == save_at:
            engine.save(sampler=sampler)
    milestones = engine.lr_scheduler.milestones
    assert isinstance(milestones, collections.Counter) and milestones[3] == 2, milestones
    return engine.state_dict(), losses, engine.optimizer.param_groups[0]["lr"]


def resume_bitwise(stage: int, root: str) -> list[Any]:
    """Uninterrupted 4 steps vs 2 steps, save, a new engine loads and does 2 more."""
    whole = _sampler_run(stage, root + "-unused", 4, None, False)
    first = _sampler_run(stage, root, 2, 2, False)
    resumed = _sampler_run(stage, root, 4, None, True)
    return [whole, first, resumed]


# ---- precision change ----

def precision_change(root: str) -> list[Any]:
    """bf16 at stage 1 saves; fp32 at stage 3 loads; its save must hold the same tensors."""
    engine = make_engine(1, precision="bf16")
    train(engine, 0, 1)
    engine.save(root + "/bf16")
    saved = engine.state_dict()
    other = make_engine(3)
    other.load(root + "/bf16")
    loaded = other.state_dict()
    other.save(root + "/fp32")
    return [saved, loaded]


# ---- damaged checkpoints ----

class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


DAMAGED_FILE = {"flip": "shard-00001-of-00002.safetensors", "delete": "rank-00001.safetensors",
                "truncate": "manifest.json"}


def _damage(root: Path, how: str) -> None:
    target = root / "step-00000003" / DAMAGED_FILE[how]
    if how == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif how == "delete":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[:100])


def damaged(root: str, kinds: list[str]) -> dict[str, Any]:
    engine = make_engine(2, checkpoint_dir=root, checkpoint_every=1, keep_last=None)
    train(engine, 0, 3)
    comm.barrier()
    if shardwise.rank() == 0:
        for how in kinds:
            shutil.copytree(root, f"{root}-{how}")
            _damage(Path(f"{root}-{how}"), how)
    comm.barrier()
    out: dict[str, Any] = {}
    capture = _Capture()
    logger = logging.getLogger("shardwise")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    try:
        for how in kinds:
            other = make_engine(2, checkpoint_dir=f"{root}-{how}", resume="auto")
            try:
                other.load()
                refused = None
            except CheckpointError as exc:
                refused = str(exc)
            capture.lines.clear()
            state = other.resume()
            out[how] = {"file": DAMAGED_FILE[how], "refused": refused,
                        "resumed_step": None if state is None else state["global_step"],
                        "global_step": other.global_step, "log": list(capture.lines)}
    finally:
        logger.removeHandler(capture)
    fresh = make_engine(2, checkpoint_dir=f"{root}-none", resume="auto")
    out["none"] = fresh.resume()
    return out


# ---- async save ----

def async_vs_sync(root: str) -> list[Any]:
    sync = make_engine(2)
    train(sync, 0, 2)
    sync.save(root + "/sync")
    train(sync, 2, 3)
    background = make_engine(2, async_save=True)
    train(background, 0, 2)
    background.save(root + "/async")
    train(background, 2, 3)  # training goes on while the save is written
    committed = background.wait_for_checkpoint()
    return [str(committed), sync.state_dict(), background.state_dict()]


# ---- export ----

def export_source(root: str) -> dict[str, torch.Tensor]:
    engine = make_engine(3)
    train(engine, 0, 1)
    engine.save(root)
    return engine.state_dict()


def from_pretrained(stage: int, sources: list[Any]) -> list[dict[str, torch.Tensor]]:
    """A fresh engine per source (file, checkpoint dir or state dict) via load_full_state."""
    out = []
    for src in sources:
        engine = make_engine(stage)
        engine.load_full_state(src)
        out.append(engine.state_dict())
    return out


# ---- a damaged newest checkpoint is set aside; a lost journal is rebuilt ----


def set_aside_and_continue(root: str) -> dict[str, Any]:
    """Train 4 steps uninterrupted; then 3 steps saving each, damage step 3, resume (falls back
    to 2, sets 3 aside) and train on to 4, saving 3 and 4 again; then lose the journal and
    resume from the rebuilt one."""
    reference = make_engine(2)
    train(reference, 0, 4)
    engine = make_engine(2, checkpoint_dir=root, checkpoint_every=1)
    train(engine, 0, 3)
    comm.barrier()
    if shardwise.rank() == 0:
        _damage(Path(root), "flip")
    comm.barrier()
    resumed = make_engine(2, checkpoint_dir=root, checkpoint_every=1, resume="auto")
    state = resumed.resume()
    start = resumed.global_step
    train(resumed, start, 4)
    comm.barrier()
    if shardwise.rank() == 0:
        (Path(root) / "journal.log").unlink()
    comm.barrier()
    rebuilt = make_engine(2, checkpoint_dir=root, resume="auto")
    rebuilt.resume()
    return {
        "resumed_from": None if state is None else state["global_step"],
        "rebuilt_step": rebuilt.global_step,
        "reference": reference.state_dict(),
        "continued": resumed.state_dict(),
        "rebuilt": rebuilt.state_dict(),
    }

"""Checkpoint I/O at world size 2 on CPU (gloo): shardwise next to torch.save and DCP.

    python benchmarks/checkpoint_io.py [--model anchor] [--zero-stage 3] [--reps 3] [--dir DIR]

Every system saves and loads the same GPT (``GPTConfig.named(model)``) with its AdamW state,
after one optimizer step so that ``exp_avg`` / ``exp_avg_sq`` exist:

- shardwise sync: ``save_engine``; each rank writes its shard file, fsyncs it and reads it back
  to check its sha256, rank 0 commits the manifest. Load: ``load_engine`` (the ranks share the
  sha256 check of every file, then each reads its own flat ranges).
- shardwise sync, no read-back: the same with ``verify_writes=False`` (the file is still
  hashed while it is written, for the manifest), to show what the read-back check costs.
- shardwise async: ``AsyncCheckpointWriter`` (with the read-back check); the training loop is
  blocked only while the pieces are copied to host memory, then steps on while a thread writes
  and commits.
- torch.save: a replicated model (every rank holds everything, as with DDP); rank 0 writes
  ``{"model": ..., "optim": ...}`` and fsyncs it. Load: every rank ``torch.load`` +
  ``load_state_dict``.
- DCP sync / async: ``torch.distributed.checkpoint.save`` / ``async_save`` of an FSDP2 model's
  and optimizer's state dict (``get_state_dict``). Load: ``dcp.load`` + ``set_state_dict``.

Per repetition each timed call starts after a barrier and its time is the slowest rank's; the
table gives medians over repetitions. "stall" is how long the training loop is blocked by the
save; "total" is until the checkpoint is durable (committed). MB/s per rank = the largest
number of bytes one rank writes (or loads) / the time. "step during" is the median training
step while a background save runs, next to "step alone" (2 ranks share the machine's cores with
the writer threads; the step times are noisy on a shared machine). MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

import shardwise
from shardwise import comm
from shardwise.checkpoint import AsyncCheckpointWriter
from shardwise.engine.checkpoint import load_engine, save_engine
from shardwise.models import GPT, GPTConfig
from shardwise.testing import RankPool
from shardwise.zero.optimizer import state_bytes

log = logging.getLogger("checkpoint_io")

WORLD_SIZE = 2
Timings = dict[str, Any]


def _batch(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(shardwise.rank())
    t = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    comm.barrier()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _step_times(step: Callable[[], None], done: Callable[[], bool]) -> list[float]:
    """Training steps while a background save runs (at least one). The ranks agree after each
    step whether every rank's save is done, so all of them run the same number of steps."""
    times = []
    while True:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        pending = torch.tensor([0 if done() else 1])
        comm.all_reduce(pending, op="max")
        if not pending.item():
            return times


class _DoneClock:
    """Polls ``done`` from a thread (every ms) and keeps when it first returned True, so a
    background save's duration is not rounded up to the next training step."""

    def __init__(self, t0: float, done: Callable[[], bool]) -> None:
        self.elapsed_s: float | None = None
        self._thread = threading.Thread(target=self._poll, args=(t0, done), daemon=True)
        self._thread.start()

    def _poll(self, t0: float, done: Callable[[], bool]) -> None:
        while not done():
            time.sleep(0.001)
        self.elapsed_s = time.perf_counter() - t0

    def result(self) -> float:
        self._thread.join()
        assert self.elapsed_s is not None
        return self.elapsed_s


def _rank0_rmtree(path: Path) -> None:
    comm.barrier()
    if shardwise.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    comm.barrier()


# ---- shardwise ----


def _bench_shardwise(cfg: GPTConfig, stage: int, reps: int, root: Path) -> dict[str, Timings]:
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = shardwise.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), shardwise.Config(zero_stage=stage)
    )
    x, y = _batch(cfg)

    def step() -> None:
        engine.backward(engine(x, y))
        engine.step()

    step()
    payload = sum(f.master.numel() * f.master.element_size() for f in engine.flats)
    payload += state_bytes(engine.optimizer)
    alone = [_timed(step)[0] for _ in range(3)]
    shard_name = f"shard-{shardwise.rank():05d}-of-{WORLD_SIZE:05d}.safetensors"
    sync: Timings = {"stall": [], "total": [], "load": [], "load_bytes": payload}
    for i in range(reps):
        path = root / f"sw-sync-{i}"
        t, out = _timed(functools.partial(save_engine, engine, path))
        sync["stall"].append(t)
        sync["total"].append(t)
        sync["save_bytes"] = (out / shard_name).stat().st_size
        sync["load"].append(_timed(functools.partial(load_engine, engine, path))[0])
        _rank0_rmtree(path)
    unchecked: Timings = {"stall": [], "total": []}
    for i in range(reps):
        path = root / f"sw-unchecked-{i}"
        t, out = _timed(functools.partial(save_engine, engine, path, verify_writes=False))
        unchecked["stall"].append(t)
        unchecked["total"].append(t)
        unchecked["save_bytes"] = (out / shard_name).stat().st_size
        _rank0_rmtree(path)
    background: Timings = {"stall": [], "total": [], "step_alone": alone, "step_during": []}
    writer = AsyncCheckpointWriter(root / "sw-async", keep_last=1)
    for _ in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        out = save_engine(engine, writer.root, async_writer=writer)
        background["stall"].append(time.perf_counter() - t0)
        clock = _DoneClock(t0, lambda: not writer.pending)
        background["step_during"] += _step_times(step, lambda: not writer.pending)
        writer.wait()
        background["total"].append(clock.result())
        background["save_bytes"] = (out / shard_name).stat().st_size
    writer.close()
    _rank0_rmtree(root / "sw-async")
    return {
        "shardwise sync": sync,
        "shardwise sync, no read-back": unchecked,
        "shardwise async": background,
    }


# ---- torch.save of the full state ----


def _bench_torch_save(cfg: GPTConfig, reps: int, root: Path) -> dict[str, Timings]:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = _batch(cfg)
    model(x, y).backward()
    opt.step()
    path = root / "torch_save.pt"
    me = shardwise.rank()

    def save() -> None:
        if me == 0:
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
        comm.barrier()

    def load() -> None:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    out: Timings = {"stall": [], "total": [], "load": []}
    for _ in range(reps):
        t, _ = _timed(save)
        out["stall"].append(t)
        out["total"].append(t)
        out["save_bytes"] = path.stat().st_size if me == 0 else 0
        out["load_bytes"] = path.stat().st_size
        out["load"].append(_timed(load)[0])
        _rank0_rmtree(path)
    return {"torch.save": out}


# ---- torch.distributed.checkpoint with FSDP2 ----


def _local_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a (nested) state dict; a DTensor counts its shard."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        return t.numel() * t.element_size() if t.dim() > 0 else 0
    return 0


def _bench_dcp(cfg: GPTConfig, reps: int, root: Path) -> dict[str, Timings]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = _batch(cfg)

    def step() -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    step()
    alone = [_timed(step)[0] for _ in range(3)]
    me = shardwise.rank()

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def save(path: Path) -> None:
        dcp.save(state(), checkpoint_id=str(path))

    def load(path: Path) -> None:
        sd = state()
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    sync: Timings = {"stall": [], "total": [], "load": [], "load_bytes": _local_bytes(state())}
    for i in range(reps):
        path = root / f"dcp-sync-{i}"
        t, _ = _timed(functools.partial(save, path))
        sync["stall"].append(t)
        sync["total"].append(t)
        sync["save_bytes"] = (path / f"__{me}_0.distcp").stat().st_size
        sync["load"].append(_timed(functools.partial(load, path))[0])
        _rank0_rmtree(path)
    background: Timings = {"stall": [], "total": [], "step_alone": alone, "step_during": []}
    # its own group, as shardwise's writer has: the save's collectives run in a background
    # thread and must not interleave with the training step's on the default group
    save_group = dist.new_group(backend="gloo")
    for i in range(reps):
        path = root / f"dcp-async-{i}"
        comm.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state(), checkpoint_id=str(path), process_group=save_group)
        assert isinstance(future, Future)
        background["stall"].append(time.perf_counter() - t0)
        clock = _DoneClock(t0, future.done)
        background["step_during"] += _step_times(step, future.done)
        future.result()
        background["total"].append(clock.result())
        background["save_bytes"] = (path / f"__{me}_0.distcp").stat().st_size
        _rank0_rmtree(path)
    return {"DCP sync": sync, "DCP async": background}


def rank_task(model_name: str, stage: int, reps: int, root: str) -> dict[str, Timings]:
    torch.set_num_threads(1)
    cfg = GPTConfig.named(model_name)
    base = Path(root)
    out = _bench_shardwise(cfg, stage, reps, base)
    out.update(_bench_torch_save(cfg, reps, base))
    out.update(_bench_dcp(cfg, reps, base))
    return out


# ---- report ----


def summarize(per_rank: list[dict[str, Timings]]) -> list[dict[str, Any]]:
    rows = []
    for system in per_rank[0]:
        ranks = [r[system] for r in per_rank]

        def slowest(key: str, ranks: list[Timings] = ranks) -> float | None:
            if key not in ranks[0]:
                return None
            return statistics.median(max(vals) for vals in zip(*(r[key] for r in ranks)))

        row: dict[str, Any] = {
            "system": system,
            "stall": slowest("stall"),
            "total": slowest("total"),
            "load": slowest("load"),
            "save_mb": max(r["save_bytes"] for r in ranks) / 1e6,
            "load_mb": (
                max(r["load_bytes"] for r in ranks) / 1e6 if "load_bytes" in ranks[0] else None
            ),
        }
        if "step_during" in ranks[0]:
            row["step_alone"] = statistics.median(v for r in ranks for v in r["step_alone"])
            row["step_during"] = statistics.median(v for r in ranks for v in r["step_during"])
        rows.append(row)
    return rows


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    ref = next(r for r in rows if r["system"] == "shardwise sync")
    head = (
        "| system | MB written / rank | save stall s | stall vs shardwise sync | save total "
        "s | save MB/s / rank | MB loaded / rank | load s | load MB/s / rank | step alone s "
        "| step during s |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        save_rate = r["save_mb"] / r["total"] if r["save_mb"] else None
        load_rate = r["load_mb"] / r["load"] if r["load"] else None
        lines.append(
            f"| {r['system']} | {r['save_mb']:.0f} | {r['stall']:.3f} | "
            f"{r['stall'] / ref['stall']:.3f} | {r['total']:.2f} | {_f(save_rate, '.0f')} | "
            f"{_f(r['load_mb'], '.0f')} | {_f(r['load'], '.2f')} | {_f(load_rate, '.0f')} | "
            f"{_f(r.get('step_alone'), '.2f')} | {_f(r.get('step_during'), '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="anchor", help="GPT preset (default anchor, 23M)")
    ap.add_argument("--zero-stage", type=int, default=3, help="shardwise ZeRO stage (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("shardwise").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="ckpt-io-", dir=args.dir))
    t0 = time.perf_counter()
    pool = RankPool(WORLD_SIZE, pg_timeout_s=300)
    try:
        per_rank = pool.run(
            rank_task, args.model, args.zero_stage, args.reps, str(root), timeout_s=3600
        )
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    cfg = GPTConfig.named(args.model)
    log.info(
        "GPT %s (%.1fM params), AdamW, fp32, world size %d on CPU/gloo, shardwise ZeRO "
        "stage %d, DCP on FSDP2; median of %d reps, slowest rank (torch %s)",
        args.model,
        cfg.param_count() / 1e6,
        WORLD_SIZE,
        args.zero_stage,
        args.reps,
        torch.__version__,
    )
    log.info("%s", table(summarize(per_rank)))
    log.info("total wall time %.1f s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

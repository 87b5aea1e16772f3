"""Checkpoint storage on real gloo ranks: uneven shards, N -> M loading, async saves, kill -9."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardwise import comm
from shardwise import dist as sw_dist
from shardwise.checkpoint import (
    AsyncCheckpointWriter,
    CheckpointReader,
    ShardEntry,
    entries_of_flat_range,
    find_latest_valid,
    resolve,
    save_checkpoint,
    verify,
)
from shardwise.checkpoint.faults import CRASH_AT_ENV, CRASH_RANK_ENV
from shardwise.checkpoint.journal import Journal
from shardwise.checkpoint.layout import step_dir_name, tmp_dir_name
from shardwise.testing import RankError, RankTimeout, run_on_ranks

CRASH_TASK_TIMEOUT_S = 5.0  # the killed rank never reports: run_on_ranks waits this long


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model/blocks.0.attn.qkv.weight": torch.randn(7, 5, generator=g),
        "model/blocks.0.norm.weight": torch.randn(13, generator=g).to(torch.bfloat16),
        "optim/blocks.0.attn.qkv.weight/exp_avg": torch.randn(7, 5, generator=g),
        "master/step_count": torch.arange(11, dtype=torch.int64) + step,
    }


def _bounds(numel: int, weights: list[int]) -> list[int]:
    """Cut ``[0, numel)`` into len(weights) ranges proportional to ``weights``."""
    total = sum(weights)
    acc = [0]
    for w in weights:
        acc.append(acc[-1] + w)
    return [numel * a // total for a in acc]


def _rank_ranges(name: str, numel: int, rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's flat ranges of ``name``: four different uneven ownership patterns."""
    if name.endswith("qkv.weight"):  # rank r holds a share proportional to r + 1
        b = _bounds(numel, [r + 1 for r in range(world)])
        return [(b[rank], b[rank + 1])]
    if name.endswith("exp_avg"):  # even split, owned in reverse rank order
        b = _bounds(numel, [1] * world)
        return [(b[world - 1 - rank], b[world - rank])]
    if name.endswith("norm.weight"):  # replicated: the last rank alone gives it
        return [(0, numel)] if rank == world - 1 else []
    b = _bounds(numel, [1] * (2 * world))  # two disjoint ranges per rank
    return [(b[rank], b[rank + 1]), (b[2 * world - 1 - rank], b[2 * world - rank])]


def _rank_entries(step: int) -> list[ShardEntry]:
    rank, world = sw_dist.rank(), sw_dist.world_size()
    out = []
    for name, t in _full(step).items():
        flat = t.reshape(-1)
        for lo, hi in _rank_ranges(name, flat.numel(), rank, world):
            out += entries_of_flat_range(name, tuple(t.shape), lo, flat[lo:hi].clone())
    return out


def _trainer_state(step: int) -> dict[str, object]:
    return {
        "global_step": step,
        "config": {"zero_stage": 3, "precision": "bf16"},
        "layout": {"dp_size": sw_dist.world_size()},
        "loss_scaler": {"scale": 65536.0},
        "sampler": {"epoch": 0, "index": 17 * step},
    }


def _rank_state() -> dict[str, object]:
    return {
        "rank": sw_dist.rank(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }


# ---- functions run on every rank (module level so spawned ranks can import them) ----


def rank_save(root: str, step: int) -> str:
    path = save_checkpoint(root, step, _rank_entries(step), _trainer_state(step), _rank_state(), group=comm.world())
    return str(path)


def rank_save_crashing(root: str, step: int, point: str, crash_rank: int) -> str:
    os.environ[CRASH_AT_ENV] = point
    os.environ[CRASH_RANK_ENV] = str(crash_rank)
    os.environ["SHARDWISE_TRACE_DIR"] = str(Path(root).parent / "traces")  # survivors' traces
    return rank_save(root, step)


def rank_save_async(root: str, step: int) -> tuple[str, float, bool]:
    writer = AsyncCheckpointWriter(root, timeout_s=30, group=comm.world())
    entries = _rank_entries(step)
    writer.save(step, entries, _trainer_state(step), _rank_state())
    for e in entries:  # the writer holds a snapshot: the engine may update in place
        e.tensor.fill_(-1)
    t = torch.ones(4)
    for _ in range(3):  # training collectives on the main group while the save runs
        comm.all_reduce(t)
    path = writer.wait()
    dedicated = writer.group.pg is not None and writer.group.pg is not dist.group.WORLD
    return str(path), float(t[0]), dedicated


def rank_read_even_split(root: str) -> dict[str, torch.Tensor]:
    """Load as an engine at this world size would: each rank reads its even flat chunk."""
    rank, world = sw_dist.rank(), sw_dist.world_size()
    with CheckpointReader(root) as reader:
        assert reader.world_size != world  # written at another world size
        out = {}
        for name in reader.names():
            b = _bounds(math.prod(reader.full_shape(name)), [1] * world)
            out[name] = reader.read_range(name, b[rank], b[rank + 1])
        return out


# ---- checks in the test process (reading needs no process group) ----


def _assert_holds(path: Path, step: int, world: int) -> None:
    verify(path)
    with CheckpointReader(path) as reader:
        assert reader.world_size == world and reader.step == step
        for name, t in _full(step).items():
            got = reader.read_full(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
        assert reader.trainer_state["sampler"] == {"epoch": 0, "index": 17 * step}
        for r in range(world):
            state = reader.rank_state(r)
            assert state["rank"] == r and isinstance(state["torch_cpu"], torch.Tensor)


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_shards_round_trip(tmp_path: Path, world: int) -> None:
    paths = run_on_ranks(world, rank_save, str(tmp_path), 5, timeout_s=60)
    assert paths == [str(tmp_path / step_dir_name(5))] * world
    _assert_holds(tmp_path / step_dir_name(5), 5, world)
    files = sorted(p.name for p in (tmp_path / step_dir_name(5)).glob("shard-*"))
    assert files == [f"shard-{r:05d}-of-{world:05d}.safetensors" for r in range(world)]


@pytest.mark.parametrize("saved_at, loaded_at", [(2, 3), (3, 2)])
def test_load_at_another_world_size(tmp_path: Path, saved_at: int, loaded_at: int) -> None:
    run_on_ranks(saved_at, rank_save, str(tmp_path), 9, timeout_s=60)
    chunks = run_on_ranks(loaded_at, rank_read_even_split, str(tmp_path), timeout_s=60)
    for name, t in _full(9).items():
        assert torch.equal(torch.cat([c[name] for c in chunks]), t.reshape(-1)), name
    with CheckpointReader(tmp_path) as reader:  # and any other split, e.g. 4 or 5 ranks
        for m in (4, 5):
            for name, t in _full(9).items():
                b = _bounds(t.numel(), [1] * m)
                got = torch.cat([reader.read_range(name, b[i], b[i + 1]) for i in range(m)])
                assert torch.equal(got, t.reshape(-1))


@pytest.mark.parametrize("world", [2, 3])
def test_async_writer_matches_sync(tmp_path: Path, world: int) -> None:
    results = run_on_ranks(world, rank_save_async, str(tmp_path / "async"), 6, timeout_s=60)
    expected = (str(tmp_path / "async" / step_dir_name(6)), float(world**3), True)
    assert results == [expected] * world
    run_on_ranks(world, rank_save, str(tmp_path / "sync"), 6, timeout_s=60)
    _assert_holds(tmp_path / "async" / step_dir_name(6), 6, world)
    with CheckpointReader(tmp_path / "async") as a, CheckpointReader(tmp_path / "sync") as s:
        assert a.manifest.tensors == s.manifest.tensors
        assert a.trainer_state == s.trainer_state
        for name, f in a.manifest.files.items():
            if f.kind == "shard":
                assert f.sha256 == s.manifest.files[name].sha256


def _assert_crashed_at(point: str, leftover: Path, previous: Path, rank: int, world: int) -> None:
    """The files on disk show the rank died where it was told to."""
    shard = f"shard-{rank:05d}-of-{world:05d}.safetensors"
    full_size = (previous / shard).stat().st_size  # step 2 has the same shapes as step 1
    assert leftover.is_dir()
    if point == "before_files":
        assert not (leftover / shard).exists()
    elif point == "mid_file":
        assert 0 < (leftover / shard).stat().st_size < full_size
    else:
        assert (leftover / shard).stat().st_size == full_size
    assert (leftover / "manifest.json").exists() == (point == "during_rename")


@pytest.mark.parametrize(
    "point, world, crash_rank",
    [
        ("before_files", 3, 2),
        ("mid_file", 2, 1),
        ("after_files", 3, 1),
        ("during_rename", 2, 0),
    ],
)
def test_kill_during_save(tmp_path: Path, point: str, world: int, crash_rank: int) -> None:
    root = tmp_path / "ck"
    run_on_ranks(world, rank_save, str(root), 1, timeout_s=60)
    with pytest.raises((RankError, RankTimeout)) as info:
        run_on_ranks(
            world,
            rank_save_crashing,
            str(root),
            2,
            point,
            crash_rank,
            timeout_s=CRASH_TASK_TIMEOUT_S,
            fresh=True,
        )
    # The survivors fail on the lost peer (or the pool reports the death), not on save logic.
    assert "CheckpointError" not in str(info.value) and "ValueError" not in str(info.value)
    # The interrupted step 2 does not exist for readers; step 1 is intact.
    assert Journal(root).read().live_steps() == [1]
    assert resolve(root) == root / step_dir_name(1)
    path, skipped = find_latest_valid(root)
    assert path == root / step_dir_name(1)
    leftover = root / (step_dir_name(2) if point == "during_rename" else tmp_dir_name(2))
    _assert_crashed_at(point, leftover, root / step_dir_name(1), crash_rank, world)
    assert [p for p, _ in skipped] == ([leftover] if point == "during_rename" else [])
    _assert_holds(path, 1, world)
    # The next save cleans the leftovers and commits the same step.
    run_on_ranks(world, rank_save, str(root), 2, timeout_s=60)
    assert not (root / tmp_dir_name(2)).exists()
    assert Journal(root).read().live_steps() == [1, 2]
    _assert_holds(resolve(root), 2, world)

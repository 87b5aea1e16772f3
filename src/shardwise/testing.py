"""Run a function on W real ranks (spawned processes, gloo, a FileStore in a temp dir).

Spawning ranks costs seconds, so a ``RankPool`` keeps its W processes alive and runs one task
after another on them; each task starts from reset shardwise state. A task that fails or times
out retires the pool (its ranks may be stuck in a collective); the next task gets a fresh one.

    pool = RankPool(3)
    results = pool.run(my_module_level_fn, arg1, timeout_s=60)  # one result per rank
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TASK_TIMEOUT_S = 240.0


class RankError(AssertionError):
    """A rank raised inside a task; the message carries that rank's traceback."""


class RankTimeout(AssertionError):
    """A task did not finish on every rank in time."""


def _reset_rank_state(seed: int, pg_timeout_s: float) -> None:
    """A fresh current world (new counters and trace, debug following the environment) over the
    same process group, and every RNG seeded."""
    from shardwise.comm import current_world
    from shardwise.seeding import seed_all

    current_world.attach(timeout=pg_timeout_s)
    seed_all(seed)


def _release_task_groups(pg_timeout_s: float) -> None:
    """After a task that succeeded here: once every rank is past it (a barrier on the default
    group), destroy the process groups it formed and collect them. Each live gloo group keeps
    worker threads that cost CPU while idle (12 threads per dp2 x tp2 mesh), and a pool runs
    hundreds of tasks. A rank not arriving keeps them (a failed task closes the pool anyway)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from shardwise.checkpoint.async_writer import finish_pending_saves

    finish_pending_saves("after a task")
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=pg_timeout_s))
    except Exception:
        return
    default = c10d._get_default_group()
    for pg in list(c10d._world.pg_map):
        if pg is not default:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)
    gc.collect()


def _worker(
    rank: int,
    world_size: int,
    store_dir: str,
    tasks: Any,
    results: Any,
    pg_timeout_s: float,
    keep_groups: bool,
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    from shardwise.comm import current_world

    current_world.attach(timeout=pg_timeout_s)
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs, seed = task
        try:
            _reset_rank_state(seed, pg_timeout_s)
            value = fn(*args, **kwargs)
            if not keep_groups:
                _release_task_groups(pg_timeout_s)
            results.put((rank, "ok", value))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class RankPool:
    """W live ranks on gloo that run tasks on demand.

    After each task the ranks destroy the torch groups it formed (idle gloo groups cost CPU).
    ``keep_groups=True`` keeps them, for tasks that leave engines or groups behind for a later
    task (a benchmark that times the same engines in turns)."""

    def __init__(
        self,
        world_size: int,
        pg_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        keep_groups: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix=f"shardwise-pool{world_size}-")
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                daemon=True,
                name=f"shardwise-rank{r}",
                args=(
                    r,
                    world_size,
                    self._dir,
                    self._tasks[r],
                    self._results,
                    pg_timeout_s,
                    keep_groups,
                ),
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True
        self._collect("start", start_timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[str, Any]] = {}
        first_error: tuple[int, str] | None = None
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and first_error is None:
                    first_error = (
                        dead[0],
                        f"rank {dead[0]} process died (exit code {self._procs[dead[0]].exitcode})",
                    )
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            got[rank] = (status, value)
            if status == "error" and first_error is None:
                first_error = (rank, value)
            if first_error is not None:  # give the other ranks a moment to report, then stop
                deadline = min(deadline, time.monotonic() + 5.0)
        if first_error is not None:
            self.close()
            rank, tb = first_error
            others = {r: v for r, (s, v) in got.items() if s == "error" and r != rank}
            extra = "".join(f"\n--- rank {r} also failed ---\n{v}" for r, v in others.items())
            raise RankError(f"{what} failed on rank {rank} of {self.world_size}:\n{tb}{extra}")
        if len(got) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(got))
            self.close()
            raise RankTimeout(
                f"{what} did not finish within {timeout_s:g} s on ranks {missing} "
                f"of {self.world_size}"
            )
        return [got[r][1] for r in range(self.world_size)]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
        seed: int = 0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return each rank's result, rank order.

        ``fn`` must be importable (module level) so spawned ranks can unpickle it.
        """
        if not self.alive:
            raise RuntimeError("this RankPool was closed")
        for q in self._tasks:
            q.put((fn, args, kwargs, seed))
        return self._collect(getattr(fn, "__name__", "task"), timeout_s)

    def close(self) -> None:
        if self._ask_to_stop():
            self._reap(time.monotonic() + 3)

    def _ask_to_stop(self) -> bool:
        """Tell every rank to leave; False if the pool was already closed."""
        if not self.alive:
            return False
        self.alive = False
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        return True

    def _reap(self, deadline: float) -> None:
        """Wait for the ranks until ``deadline``, then kill what is left."""
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)


_pools: dict[int, RankPool] = {}


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks from a pool kept for the whole process.

    ``fresh=True`` uses a one-off pool (for tests that break their world on purpose).
    """
    if fresh:
        pool = RankPool(world_size)
        try:
            return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
        finally:
            pool.close()
    kept = _pools.get(world_size)
    if kept is None or not kept.alive:
        kept = _pools[world_size] = RankPool(world_size)
    return kept.run(fn, *args, timeout_s=timeout_s, **kwargs)


def close_pools() -> None:
    # every pool's ranks leave at once, so the pools' waits overlap
    stopping = [pool for pool in _pools.values() if pool._ask_to_stop()]
    deadline = time.monotonic() + 3
    for pool in stopping:
        pool._reap(deadline)
    _pools.clear()


class SavedTensorBytes:
    """Unique storage bytes autograd saves for backward while ``measure`` runs, parameters of
    ``model`` excluded: what a forward keeps for its backward (activations), measured.
    ``already``: another measurement whose storages count as seen."""

    def __init__(self, model: Any, already: SavedTensorBytes | None = None) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # storages are held so no address is reused; ``already``'s count as seen
        self._seen: dict[int, Any] = dict(already._seen) if already else {}

    def measure(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` counting what it saves; return its result."""
        import torch

        def pack(t: Any) -> Any:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._params:
                self._seen.setdefault(storage.data_ptr(), storage)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return fn()

    @property
    def total(self) -> int:
        """Bytes of the storages seen."""
        return sum(int(s.nbytes()) for s in self._seen.values())

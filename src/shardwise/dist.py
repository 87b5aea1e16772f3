"""The distributed context: who am I, how many are we, and the process group that joins us.

`init` reads the environment that torchrun, mpirun (Open MPI / PMI) or SLURM set. With none of
them the process is a world of one and the process group lives in memory (no network).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("shardwise")

BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEFAULT_TIMEOUT_S = 300.0


class DistInitError(RuntimeError):
    """The process group could not be formed (a rank never joined, bad backend, bad env)."""


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "mpi" | "slurm" | "single"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[03-05,09],gpu1`` -> ``node03``."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head.strip()
    prefix, rest = head.split("[", 1)
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return prefix + first


def _int_env(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError as exc:
                raise DistInitError(
                    f"environment variable {name}={env[name]!r} is not an int"
                ) from exc
    return None


def read_launch_env(env: dict[str, str] | None = None) -> LaunchEnv:
    """Work out rank, world size and rendezvous address from the launcher's variables.

    Checked in order: torchrun (RANK/WORLD_SIZE), Open MPI (OMPI_COMM_WORLD_*), PMI (PMI_RANK/SIZE),
    SLURM (SLURM_PROCID/NTASKS). None of them: a world of one.
    """
    env = dict(os.environ if env is None else env)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int_env(env, "MASTER_PORT") or 29500
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local = _int_env(env, "LOCAL_RANK")
        source = "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank = _int_env(env, "OMPI_COMM_WORLD_RANK")
        world = _int_env(env, "OMPI_COMM_WORLD_SIZE")
        local = _int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        source = "mpi"
    elif "PMI_RANK" in env:
        rank, world = _int_env(env, "PMI_RANK"), _int_env(env, "PMI_SIZE")
        local = _int_env(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
        source = "mpi"
    elif "SLURM_PROCID" in env:
        rank, world = _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_NTASKS")
        local = _int_env(env, "SLURM_LOCALID")
        if "MASTER_ADDR" not in env and "SLURM_NODELIST" in env:
            addr = _first_slurm_host(env["SLURM_NODELIST"])
        source = "slurm"
    else:
        return LaunchEnv(0, 1, 0, addr, port, "single")
    if rank is None or world is None:
        raise DistInitError(f"{source} environment is incomplete: rank={rank} world_size={world}")
    if not 0 <= rank < world:
        raise DistInitError(f"rank {rank} is outside world size {world} ({source} environment)")
    return LaunchEnv(rank, world, local if local is not None else 0, addr, port, source)


@dataclass
class _Context:
    env: LaunchEnv
    backend: str
    timeout_s: float
    owns_group: bool


_ctx: _Context | None = None


def resolve_backend(backend: str) -> str:
    """Map ``auto`` to nccl (CUDA present) or gloo, and check the backend is built in."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    available = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    if not available[backend]:
        have = [b for b, ok in available.items() if ok]
        raise ValueError(
            f"backend {backend!r} is not available in this PyTorch build; available: {have}"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA devices, and none are visible; use 'gloo'")
    return backend


def init(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Join (or form) the world's process group. Calling it again is harmless.

    Args:
        backend: "auto" (nccl with CUDA, else gloo), "gloo", "nccl" or "mpi".
        timeout: seconds any rank waits for the others, at rendezvous and in every collective.
    """
    global _ctx
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if _ctx is not None:
        return
    backend = resolve_backend(backend)
    env = read_launch_env()
    if dist.is_initialized():  # someone (a test harness, the user) formed it already
        _ctx = _Context(env, dist.get_backend(), timeout, owns_group=False)
        return
    td = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    try:
        if env.world_size == 1 and env.source == "single":
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td
            )
        elif backend == "mpi":
            dist.init_process_group("mpi", timeout=td)
        else:  # env:// reuses torchrun's agent store when there is one
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
            dist.init_process_group(
                backend, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=td
            )
    except (RuntimeError, dist.DistError) as exc:
        raise DistInitError(
            f"rank {env.rank} could not form the {backend} process group of {env.world_size} "
            f"ranks at {env.master_addr}:{env.master_port} within the timeout of {timeout:g} s "
            f"(waited for all {env.world_size} ranks to join the rendezvous): {exc}"
        ) from exc
    _ctx = _Context(env, backend, timeout, owns_group=True)
    log.debug("rank %d/%d joined (%s, %s)", env.rank, env.world_size, backend, env.source)


def attach(timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Adopt a process group formed elsewhere (e.g. by the test harness)."""
    global _ctx
    if not dist.is_initialized():
        raise RuntimeError("attach() needs an initialized torch.distributed process group")
    env = LaunchEnv(
        dist.get_rank(),
        dist.get_world_size(),
        int(os.environ.get("LOCAL_RANK", 0)),
        "",
        0,
        "external",
    )
    _ctx = _Context(env, dist.get_backend(), timeout, owns_group=False)


def is_initialized() -> bool:
    return _ctx is not None or dist.is_initialized()


def _require() -> _Context:
    if _ctx is None:
        if dist.is_initialized():
            attach()
        else:
            init()
    assert _ctx is not None
    return _ctx


def rank() -> int:
    """This process's rank in the world."""
    return dist.get_rank() if dist.is_initialized() else _require().env.rank


def world_size() -> int:
    """Number of ranks in the world."""
    return dist.get_world_size() if dist.is_initialized() else _require().env.world_size


def local_rank() -> int:
    """This process's rank on its node."""
    return _require().env.local_rank


def backend() -> str:
    return _require().backend


def timeout_s() -> float:
    """Seconds a collective may wait before it is declared hung."""
    return _require().timeout_s if (_ctx or dist.is_initialized()) else DEFAULT_TIMEOUT_S


def device() -> torch.device:
    """``cuda:local_rank`` on the nccl backend, else ``cpu``."""
    ctx = _require()
    if ctx.backend == "nccl":
        return torch.device("cuda", ctx.env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def barrier() -> None:
    """Wait until every rank of the world arrives (bounded by the init timeout)."""
    from shardwise.comm import ops

    ops.barrier()


def shutdown() -> None:
    """Leave the process group (only if shardwise formed it)."""
    global _ctx
    if _ctx is not None and _ctx.owns_group and dist.is_initialized():
        # Leave together: a gloo rank that tears down its pairs while a peer is still sending
        # can abort that peer.
        if dist.get_world_size() > 1:
            barrier()
        for hook in _BEFORE_LEAVING:
            hook()  # e.g. background checkpoint saves, whose groups go away next
        dist.destroy_process_group()
    _ctx = None


_BEFORE_LEAVING: list[Callable[[], None]] = []


def before_leaving(hook: Callable[[], None]) -> None:
    """Run ``hook`` in ``shutdown``, before the process groups are destroyed."""
    _BEFORE_LEAVING.append(hook)

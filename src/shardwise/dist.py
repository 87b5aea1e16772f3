"""The process's place in a launch: who am I, how many are we, and torch's default process
group that joins us. Holds no state of its own (a world's state is a value: ``comm.World``).

`form_process_group` reads the environment that torchrun, mpirun (Open MPI / PMI) or SLURM set.
With none of them the process is a world of one and the process group lives in memory.
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


@dataclass(frozen=True)
class Joined:
    """The outcome of joining torch's default process group."""

    env: LaunchEnv
    backend: str
    owns_group: bool  # True: formed here, so leaving it is ours to do


def form_process_group(backend: str, timeout_s: float) -> Joined:
    """Form torch's default process group from the launcher's environment, or adopt the one
    someone (a test harness, the user) formed already.

    Args:
        backend: "auto" (nccl with CUDA, else gloo), "gloo", "nccl" or "mpi".
        timeout_s: seconds any rank waits for the others at the rendezvous.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
    backend = resolve_backend(backend)
    if dist.is_initialized():
        return adopt_process_group()
    env = read_launch_env()
    td = datetime.timedelta(seconds=timeout_s)
    _import_world_capturers()
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
            f"ranks at {env.master_addr}:{env.master_port} within the timeout of {timeout_s:g} s "
            f"(waited for all {env.world_size} ranks to join the rendezvous): {exc}"
        ) from exc
    log.debug("rank %d/%d joined (%s, %s)", env.rank, env.world_size, backend, env.source)
    return Joined(env, backend, owns_group=True)


def _import_world_capturers() -> None:
    """Import, before the default group exists, the torch modules that bind ``group.WORLD`` as a
    default argument at import (``torch.distributed.nn.functional``; torch's optimizers import it
    lazily). Imported later, they would reference the default group for the rest of the process,
    so that leaving could never destroy it and its worker threads would outlive the interpreter
    (see ``comm.current_world._destroy``)."""
    import torch.distributed.nn.functional  # noqa: F401


def adopt_process_group() -> Joined:
    """Describe torch's default process group, formed elsewhere (e.g. by the test harness)."""
    if not dist.is_initialized():
        raise RuntimeError("needs an initialized torch.distributed process group")
    env = LaunchEnv(
        dist.get_rank(),
        dist.get_world_size(),
        int(os.environ.get("LOCAL_RANK", 0)),
        "",
        0,
        "external",
    )
    return Joined(env, dist.get_backend(), owns_group=False)


_BEFORE_LEAVING: list[Callable[[str], None]] = []


def before_leaving(hook: Callable[[str], None]) -> None:
    """Run ``hook(when)`` when shardwise leaves the process group, before the groups are
    destroyed (e.g. to finish background checkpoint saves, whose groups go away next); ``when``
    says which end it is, e.g. "at exit"."""
    _BEFORE_LEAVING.append(hook)


def run_before_leaving(when: str) -> None:
    """Run the ``before_leaving`` hooks (they may still communicate on their own groups)."""
    for hook in _BEFORE_LEAVING:
        hook(when)


def leave_process_group() -> None:
    """Destroy torch's default process group and every group formed from it (callers first run
    ``run_before_leaving`` and make sure every rank is done)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    """This process's rank in torch's default process group, or the launcher's before one is
    formed."""
    return dist.get_rank() if dist.is_initialized() else read_launch_env().rank


def world_size() -> int:
    """The size of torch's default process group, or the launcher's before one is formed."""
    return dist.get_world_size() if dist.is_initialized() else read_launch_env().world_size


def device_of(backend: str, local_rank: int) -> torch.device:
    """``cuda:local_rank`` on the nccl backend, else ``cpu``."""
    if backend == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")

"""The current world: the one ``World`` that the public facade (``shardwise.rank()``,
``shardwise.comm_stats()``, ``shardwise.all_reduce(t)`` with no group) works on.

Library code never reads it: every library function takes its group (or mesh) as an argument.
"""

from __future__ import annotations

import atexit
import logging

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import dist as sw_dist
from shardwise.comm import ops
from shardwise.comm.groups import Group, World

log = logging.getLogger("shardwise")

DEFAULT_TIMEOUT_S = sw_dist.DEFAULT_TIMEOUT_S

_current: World | None = None
_exit_registered = False


def _world_of(joined: sw_dist.Joined, timeout_s: float) -> World:
    return World(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=joined.env.local_rank,
        backend=joined.backend,
        timeout_s=timeout_s,
        pg=dist.group.WORLD,
        owns_pg=joined.owns_group,
    )


def init(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT_S) -> World:
    """Join (or form) the world's process group and return the world; it becomes the current
    world. Calling it again returns the same world.

    Args:
        backend: "auto" (nccl with CUDA, else gloo), "gloo", "nccl" or "mpi".
        timeout: seconds any rank waits for the others, at rendezvous and in every collective.
    """
    global _current
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if _current is None:
        _current = _world_of(sw_dist.form_process_group(backend, timeout), timeout)
        if _current.owns_pg:
            _leave_at_exit_once()
    return _current


def attach(timeout: float = DEFAULT_TIMEOUT_S) -> World:
    """A fresh world (new counters and trace) over torch's default process group formed
    elsewhere (e.g. by the test harness); it becomes the current world."""
    global _current
    _current = _world_of(sw_dist.adopt_process_group(), timeout)
    return _current


def current() -> World:
    """The current world; the first use without ``init`` forms it (a world of one without a
    launcher, or adopts a process group formed elsewhere)."""
    if _current is not None:
        return _current
    return attach() if dist.is_initialized() else init()


def is_initialized() -> bool:
    return _current is not None or dist.is_initialized()


def shutdown() -> None:
    """Leave the process group (only if shardwise formed it); the current world ends."""
    global _current
    world, _current = _current, None
    if world is not None and world.owns_pg and dist.is_initialized():
        _leave(world, "at shardwise.shutdown()", together=True)


def _leave(world: World, when: str, together: bool) -> None:
    """The hooks first (a background save still talks on its own group), then leave (after a
    barrier when ``together``: a gloo rank that tears down its pairs while a peer is still
    sending, on any group, can abort that peer)."""
    sw_dist.run_before_leaving(when)
    if together and world.world_size > 1:
        ops.barrier(group=world.group)
    sw_dist.leave_process_group()


def _leave_at_exit_once() -> None:
    """At the end of a process that formed its group and never called ``shutdown()``, leave it
    while the interpreter is still whole: torch's gloo groups left to the interpreter's teardown
    can abort the process ("terminate called without an active exception")."""
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    global _current
    world, _current = _current, None
    if world is None or not world.owns_pg or not dist.is_initialized():
        return
    # No barrier: the process may be ending on an error (a KeyboardInterrupt, sys.exit(1)) while
    # its peers still compute; ending leaves its links anyway, this only does it in order.
    try:
        _leave(world, "at exit", together=False)
    except Exception as exc:  # the process is ending: say so and leave anyway
        log.warning("rank %d: leaving the process group at exit: %s", world.rank, exc)
        sw_dist.leave_process_group()


def resolve(group: Group | ProcessGroup | None) -> Group:
    """For public APIs: None (the current world), a shardwise Group or a torch ProcessGroup."""
    if group is None:
        return current().group
    if isinstance(group, Group):
        return group
    if isinstance(group, ProcessGroup):
        return current().adopt(group)
    raise TypeError(
        f"group must be None, a shardwise Group or a torch ProcessGroup, got {type(group).__name__}"
    )


def rank() -> int:
    """This process's rank in the current world."""
    return current().rank


def world_size() -> int:
    """Number of ranks in the current world."""
    return current().world_size


def local_rank() -> int:
    """This process's rank on its node."""
    return current().local_rank


def backend() -> str:
    return current().backend


def device() -> torch.device:
    """``cuda:local_rank`` on the nccl backend, else ``cpu``."""
    return current().device


def barrier() -> None:
    """Wait until every rank of the current world arrives (bounded by its timeout)."""
    ops.barrier(group=current().group)

"""The current world: the one ``World`` that the public facade (``shardwise.rank()``,
``shardwise.comm_stats()``, ``shardwise.all_reduce(t)`` with no group) works on.

Library code never reads it: every library function takes its group (or mesh) as an argument.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import dist as sw_dist
from shardwise.comm import ops
from shardwise.comm.groups import Group, World

log = logging.getLogger("shardwise")

DEFAULT_TIMEOUT_S = sw_dist.DEFAULT_TIMEOUT_S
DESTROY_WAIT_S = 30.0
"""How long leaving waits for torch's groups to finish their queued work and stop their threads."""

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
    sending, on any group, can abort that peer), then destroy torch's groups for good."""
    sw_dist.run_before_leaving(when)
    if together and world.world_size > 1:
        ops.barrier(group=world.group)
    sw_dist.leave_process_group()
    _destroy(world, when)


def _destroy(world: World, when: str) -> None:
    """Drop the last references to the world's torch groups, which destroys them: each gloo
    group first runs what is queued on it, then joins its worker threads.

    Why it must happen here: ``destroy_process_group`` only forgets the groups; while anything
    (this world's groups, an engine) still references one, its gloo worker threads live on. A
    worker that finishes a collective drops its tensors afterwards, and dropping a tensor that
    Python also sees takes the GIL. If the interpreter is already finalizing by then, CPython
    ends that thread with ``pthread_exit``, whose unwinding through torch's ``noexcept``
    destructor calls ``std::terminate``: "terminate called without an active exception", exit
    134, after a run that succeeded (#22). Done here, the workers take the GIL while it is free
    (torch releases it while a group is destroyed) and are gone before the teardown begins.

    The groups are dropped on a helper thread, waited for at most ``DESTROY_WAIT_S``: a group
    with work queued that a departed peer never matches would otherwise hold the end of the
    process until that work times out."""
    groups = world.release()
    if not groups:
        return
    args = (groups, world.rank)
    done = threading.Thread(target=_drop, args=args, name="shardwise-leave", daemon=True)
    done.start()
    del groups, args
    done.join(DESTROY_WAIT_S)
    if done.is_alive():
        log.warning(
            "rank %d: torch's process groups still had collectives in flight %g s after leaving "
            "%s; ending without waiting for them (the process may abort at its end)",
            world.rank,
            DESTROY_WAIT_S,
            when,
        )


def _drop(groups: list[ProcessGroup], rank: int) -> None:
    """Drop the groups: where ours is the last reference, that destroys the group."""
    while groups:
        pg = groups.pop()
        others = sys.getrefcount(pg) - 2  # besides ``pg`` and getrefcount's own argument
        if others:
            log.warning(
                "rank %d: torch's process group %s is still referenced %d times outside "
                "shardwise after leaving it; its worker threads outlive the exit and may abort "
                "the process at its end (keep no torch ProcessGroup objects)",
                rank,
                pg.group_name,
                others,
            )
        del pg  # the last reference: destroys the group, joining its worker threads


def _leave_at_exit_once() -> None:
    """At the end of a process that formed its group and never called ``shutdown()``, leave it
    while the interpreter is still whole (see ``_destroy``)."""
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
        _destroy(world, "at exit")


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

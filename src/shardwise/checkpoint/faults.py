"""Test hook: kill one rank at a chosen point of a save, to prove crashes leave no damage.

Set in the environment of the ranks (tests only; never in production)::

    SHARDWISE_CKPT_CRASH_AT    before_files | mid_file | after_files | during_rename
    SHARDWISE_CKPT_CRASH_RANK  the group rank that dies (default 0)

The chosen rank sends itself SIGKILL (no cleanup, no flush, like a node failure) at:

* ``before_files``: after the journal's ``begin`` record, before writing any of its files;
* ``mid_file``: after writing about half of its safetensors shard file;
* ``after_files``: after its files are written and fsynced, before the metadata gather;
* ``during_rename``: rank 0 only (the rank that commits), after the temp directory was renamed
  to ``step-N`` but before the journal's ``commit`` record: the directory looks complete and
  must still be ignored. With another rank this point never fires.

Unset (the default), every call is a no-op.

``SHARDWISE_CKPT_STALL_S`` (seconds) makes every rank sleep that long where ``before_files``
would fire: a save that outlasts whoever waits for it.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from shardwise import environment

log = logging.getLogger("shardwise.checkpoint")

CRASH_AT_ENV = "SHARDWISE_CKPT_CRASH_AT"
CRASH_RANK_ENV = "SHARDWISE_CKPT_CRASH_RANK"
STALL_ENV = "SHARDWISE_CKPT_STALL_S"


def crash_point() -> str | None:
    """The crash point configured in the environment, or None."""
    point: str | None = environment.read(CRASH_AT_ENV)
    return point


def maybe_crash(point: str, rank: int) -> None:
    """SIGKILL this process if the environment asks ``rank`` to die at ``point``."""
    assert point in environment.CRASH_POINTS, point
    if crash_point() != point:
        return
    if (environment.read(CRASH_RANK_ENV) or 0) == rank:
        log.warning("rank %d: test hook %s=%s: killing this process", rank, CRASH_AT_ENV, point)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_stall() -> None:
    """Sleep ``SHARDWISE_CKPT_STALL_S`` seconds if the environment sets it."""
    seconds = environment.read(STALL_ENV)
    if seconds is None:
        return
    log.warning("test hook %s=%s: stalling this save", STALL_ENV, seconds)
    time.sleep(seconds)

"""What every rank process of ``shardwise run`` / ``shardwise train`` runs first.

``python -m shardwise.cli.run_rank script.py ARGS`` (or ``-m module ARGS``) ties the process's
life to its launcher, then runs the target as ``__main__``:

- On Linux the kernel sends SIGKILL to the rank when its launcher dies (``prctl`` with
  ``PR_SET_PDEATHSIG``), even by ``kill -9``.
- Everywhere, a daemon thread watches the parent pid and kills the rank when the launcher is
  gone (the rank is re-parented), which also covers the launcher dying before ``prctl`` ran.

A ``KeyboardInterrupt`` that escapes the target (SIGINT to this rank) ends the rank with exit
code 130 and one line, not a traceback and exit code 1.
"""

from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Sequence

from shardwise import environment

LAUNCHER_PID_ENV = "SHARDWISE_LAUNCHER_PID"
"""The launcher sets it to its own pid in every rank's environment."""

WATCHDOG_INTERVAL_S = 0.5
"""How often the watchdog thread checks that the launcher is alive."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = logging.getLogger("shardwise.run")


def set_parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).
    Returns whether that is in place."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(launcher_pid: int, interval_s: float) -> None:
    while os.getppid() == launcher_pid:
        time.sleep(interval_s)
    _die()


def tie_to_launcher(launcher_pid: int, interval_s: float = WATCHDOG_INTERVAL_S) -> bool:
    """Make this process die with ``launcher_pid``, its parent. Returns whether the kernel's
    parent-death signal is in place (the watchdog thread runs either way)."""
    kernel = set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher_pid:  # the launcher died before the line above
        _die()
    threading.Thread(
        target=_watch, args=(launcher_pid, interval_s), daemon=True, name="shardwise-watchdog"
    ).start()
    return kernel


def run_target(target: Sequence[str]) -> None:
    """Run ``script.py ARGS`` or ``-m module ARGS`` as ``__main__`` with ``sys.argv`` set."""
    if not target:
        raise ValueError("run_rank needs a script or -m module to run")
    if target[0] == "-m":
        if len(target) < 2:
            raise ValueError("run_rank: -m needs a module name")
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        return
    script = target[0]
    sys.argv = list(target)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    target = list(sys.argv[1:] if argv is None else argv)
    launcher = environment.read(LAUNCHER_PID_ENV)
    if launcher is not None:
        tie_to_launcher(launcher)
    try:
        run_target(target)
    except KeyboardInterrupt:
        rank = os.environ.get("RANK", "?")
        print(f"rank {rank}: interrupted (SIGINT)", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every ``SHARDWISE_*`` environment variable the library reads, parsed in one place.

Each variable has a type and the values it accepts; junk in one raises ``EnvError`` (a
``ValueError``), one line naming the variable, its value and what it accepts. The launchers
(``shardwise run``, ``shardwise train``) call ``check_environment`` before any rank starts,
so a bad value is one line and exit code 2, not a traceback from every rank.

====================================  =======================================================
``SHARDWISE_DEBUG_COLLECTIVES``       0/1, true/false, yes/no, on/off: the desync check
``SHARDWISE_TRACE_DIR``               a directory for collective traces (default: the temp dir)
``SHARDWISE_EMULATE_LINK``            ``inter=alpha:<time>,bw:<rate>`` (``shardwise.comm.emulate``)
``SHARDWISE_EMULATE_NODES``           comma-separated node ids >= 0, one per rank
``SHARDWISE_EXIT_SAVE_WAIT_S``        seconds > 0 the exit waits for an unwaited save
``SHARDWISE_CKPT_CRASH_AT``           tests only: a crash point (``checkpoint.faults``)
``SHARDWISE_CKPT_CRASH_RANK``         tests only: the rank that crashes, an int >= 0
``SHARDWISE_CKPT_STALL_S``            tests only: seconds >= 0 a save stalls
``SHARDWISE_RESTART_COUNT``           set by the launcher: the restart, an int >= 0
``SHARDWISE_LAUNCHER_PID``            set by the launcher: its process id, an int >= 1
====================================  =======================================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

CRASH_POINTS = ("before_files", "mid_file", "after_files", "during_rename")

RESTART_COUNT_ENV = "SHARDWISE_RESTART_COUNT"
"""Set by the launcher in every rank's environment: 0 on the first attempt, k on the k-th
restart (and ``TORCHELASTIC_RESTART_COUNT`` alike, for scripts written for torchrun)."""
"""Where ``SHARDWISE_CKPT_CRASH_AT`` may kill a save."""
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A ``SHARDWISE_*`` variable holds a value it does not accept."""


@dataclass(frozen=True)
class EnvVar:
    """One variable: how to parse it and, for messages, what it accepts."""

    name: str
    accepts: str
    parse: Callable[[str], Any]


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise ValueError
        return value

    return parse


def _seconds(low_exclusive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < 0 or (low_exclusive and value == 0):
            raise ValueError
        return value

    return parse


def _flag(text: str) -> bool:
    low = text.strip().lower()
    if low not in _TRUE + _FALSE:
        raise ValueError
    return low in _TRUE


def _choice(text: str) -> str:
    if text not in CRASH_POINTS:
        raise ValueError
    return text


def _nodes(text: str) -> tuple[int, ...]:
    nodes = tuple(int(x) for x in text.split(","))
    if min(nodes) < 0:
        raise ValueError
    return nodes


LINK_GRAMMAR: list[Any] = []
"""The link parser, given by ``shardwise.comm.emulate`` (which owns the grammar) when it loads:
importing it from here would make the two modules import each other."""


def _link(text: str) -> Any:
    assert LINK_GRAMMAR, "shardwise.comm.emulate gives the link grammar when it is imported"
    try:
        return LINK_GRAMMAR[0](text)
    except ValueError as exc:  # its message names the field at fault
        raise EnvError(str(exc)) from None


VARIABLES = {
    v.name: v
    for v in (
        EnvVar("SHARDWISE_DEBUG_COLLECTIVES", "0/1, true/false, yes/no or on/off", _flag),
        EnvVar("SHARDWISE_TRACE_DIR", "a directory", str),
        EnvVar("SHARDWISE_EMULATE_LINK", "'inter=alpha:<time>,bw:<rate>'", _link),
        EnvVar("SHARDWISE_EMULATE_NODES", "comma-separated node ids >= 0, e.g. 0,0,1,1", _nodes),
        EnvVar("SHARDWISE_EXIT_SAVE_WAIT_S", "a number of seconds > 0", _seconds(True)),
        EnvVar("SHARDWISE_CKPT_CRASH_AT", f"one of {', '.join(CRASH_POINTS)}", _choice),
        EnvVar("SHARDWISE_CKPT_CRASH_RANK", "an int rank >= 0", _int_at_least(0)),
        EnvVar("SHARDWISE_CKPT_STALL_S", "a number of seconds >= 0", _seconds(False)),
        EnvVar("SHARDWISE_RESTART_COUNT", "an int >= 0", _int_at_least(0)),
        EnvVar("SHARDWISE_LAUNCHER_PID", "a process id >= 1", _int_at_least(1)),
    )
}
"""Every variable the library reads, by name."""


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of ``name`` (one of ``VARIABLES``), None when unset or empty.
    Raises ``EnvError`` naming the variable and what it accepts."""
    var = VARIABLES[name]
    text = (os.environ if env is None else env).get(name, "")
    if not text:
        return None
    try:
        return var.parse(text)
    except EnvError:
        raise
    except ValueError:
        raise EnvError(f"{name}={text!r}: it accepts {var.accepts} (or unset it)") from None


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Parse every ``SHARDWISE_*`` variable that is set; ``EnvError`` on the first bad one."""
    for name in VARIABLES:
        read(name, env)

"""Counters for every collective shardwise issues: calls, payload bytes and seconds per op."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return {"calls": self.calls, "bytes": self.bytes, "seconds": self.seconds}


@dataclass
class CommStats:
    """Per-op totals since the last reset.

    ``bytes`` is the payload as the communication layer defines it: the tensor for all_reduce and
    broadcast, the gathered output for all_gather, the unreduced input for reduce_scatter, the
    message for send/recv. ``seconds`` runs from the launch of an op until it is known complete
    (its ``wait()`` returned). ``exposed_seconds`` counts only the time a caller spent blocked on
    communication: what did not overlap compute.
    """

    ops: dict[str, OpStats] = field(default_factory=dict)
    exposed_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_launch(self, op: str, nbytes: int) -> None:
        with self._lock:
            s = self.ops.setdefault(op, OpStats())
            s.calls += 1
            s.bytes += int(nbytes)

    def record_done(self, op: str, seconds: float, blocked_s: float) -> None:
        with self._lock:
            self.ops.setdefault(op, OpStats()).seconds += seconds
            self.exposed_seconds += blocked_s

    def snapshot(self) -> dict[str, dict[str, int | float]]:
        with self._lock:
            return {op: s.as_dict() for op, s in sorted(self.ops.items())}

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()
            self.exposed_seconds = 0.0


STATS = CommStats()


def comm_stats(reset: bool = False) -> dict[str, dict[str, int | float]]:
    """``{op: {"calls", "bytes", "seconds"}}`` for every op issued since the last reset."""
    snap = STATS.snapshot()
    if reset:
        STATS.reset()
    return snap


def exposed_comm_seconds(reset: bool = False) -> float:
    """Seconds callers were blocked on communication (time that did not overlap compute)."""
    value = STATS.exposed_seconds
    if reset:
        STATS.exposed_seconds = 0.0
    return value

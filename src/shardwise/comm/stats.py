"""Counters for the collectives of one scope (a world, a mesh): calls, payload bytes, seconds."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    inter_node_bytes: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return {
            "calls": self.calls,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "inter_node_bytes": self.inter_node_bytes,
        }


@dataclass(eq=False)
class CommStats:
    """Per-op totals since the last reset.

    ``bytes`` is the payload as the communication layer defines it: the tensor for all_reduce and
    broadcast, the gathered output for all_gather, the unreduced input for reduce_scatter, the
    message for send/recv. ``inter_node_bytes`` is what this rank sent to ranks of other nodes
    (``shardwise.comm.crossing`` says how each op counts it). ``seconds`` runs from the launch
    of an op until it is known complete (its ``wait()`` returned). ``exposed_seconds`` counts
    only the time a caller spent blocked on communication: what did not overlap compute.

    A scope nested in another (a mesh's counters inside its world's) passes ``parent``: every op
    it records is recorded in the parent too, so the world's totals cover every group.
    """

    parent: CommStats | None = None
    ops: dict[str, OpStats] = field(default_factory=dict)
    exposed_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_launch(self, op: str, nbytes: int, inter_node_bytes: int = 0) -> None:
        with self._lock:
            s = self.ops.setdefault(op, OpStats())
            s.calls += 1
            s.bytes += int(nbytes)
            s.inter_node_bytes += int(inter_node_bytes)
        if self.parent is not None:
            self.parent.record_launch(op, nbytes, inter_node_bytes)

    def record_done(self, op: str, seconds: float, blocked_s: float) -> None:
        with self._lock:
            self.ops.setdefault(op, OpStats()).seconds += seconds
            self.exposed_seconds += blocked_s
        if self.parent is not None:
            self.parent.record_done(op, seconds, blocked_s)

    def snapshot(self, reset: bool = False) -> dict[str, dict[str, int | float]]:
        """``{op: {"calls", "bytes", "seconds", "inter_node_bytes"}}``; ``reset`` clears every
        counter after."""
        with self._lock:
            snap = {op: s.as_dict() for op, s in sorted(self.ops.items())}
            if reset:
                self.ops.clear()
                self.exposed_seconds = 0.0
        return snap

    def exposed(self, reset: bool = False) -> float:
        """Seconds callers were blocked on communication; ``reset`` zeroes that counter."""
        with self._lock:
            value = self.exposed_seconds
            if reset:
                self.exposed_seconds = 0.0
        return value

    def reset(self) -> None:
        self.snapshot(reset=True)

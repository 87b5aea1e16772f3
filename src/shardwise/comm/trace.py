"""Flight recorder for collectives, and the debug-mode check that ranks issue the same calls.

Each rank keeps its last ``TRACE_LEN`` collectives. When one fails (a timeout, a peer that died),
the rank writes the trace to stderr and to ``$SHARDWISE_TRACE_DIR/shardwise-trace-rank{R}.txt``
(default: the system temp dir), so a user sees which rank stopped where.
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import environment

TRACE_LEN = 64
DESC_BYTES = 480  # fixed-size fingerprint exchanged by the desync check


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, or the transport broke)."""


class CollectiveTimeoutError(CollectiveError):
    """A collective waited longer than its group's timeout."""


class DesyncError(RuntimeError):
    """Ranks of one group issued different collectives at the same point."""


@dataclass
class TraceEntry:
    seq: int
    op: str
    group: str
    shapes: str
    dtype: str
    start: float
    end: float | None = None

    def line(self) -> str:
        state = f"done in {self.end - self.start:.4f}s" if self.end else "NOT COMPLETED"
        return (
            f"#{self.seq:<6} {self.op:<16} group={self.group:<10} shapes={self.shapes} "
            f"dtype={self.dtype} {state}"
        )


def debug_from_env() -> bool:
    """SHARDWISE_DEBUG_COLLECTIVES set to 1, true, yes or on: the desync check is on."""
    return bool(environment.read("SHARDWISE_DEBUG_COLLECTIVES"))


class Tracer:
    """One process's flight recorder: its last ``TRACE_LEN`` collectives, oldest first."""

    def __init__(self, rank: int, length: int = TRACE_LEN) -> None:
        self.rank = rank
        self._entries: collections.deque[TraceEntry] = collections.deque(maxlen=length)

    def begin(self, op: str, group_name: str, seq: int, shapes: str, dtype: str) -> TraceEntry:
        entry = TraceEntry(seq, op, group_name, shapes, dtype, time.time())
        self._entries.append(entry)
        return entry

    def entries(self) -> list[TraceEntry]:
        return list(self._entries)

    def reset(self) -> None:
        self._entries.clear()

    def dump(self, reason: str) -> Path:
        """Write this rank's trace to stderr and to its file; returns the file."""
        lines = [f"[shardwise rank {self.rank}] collective trace ({reason}), oldest first:"]
        lines += [f"  {e.line()}" for e in self._entries]
        text = "\n".join(lines) + "\n"
        sys.stderr.write(text)
        sys.stderr.flush()
        folder = Path(environment.read("SHARDWISE_TRACE_DIR") or tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"shardwise-trace-rank{self.rank}.txt"
        path.write_text(text)
        return path

    def fail(
        self, entry: TraceEntry, group_timeout_s: float, exc: BaseException
    ) -> CollectiveError:
        """Turn a transport exception into a shardwise error after writing the trace."""
        msg = str(exc)
        timed_out = "timed out" in msg.lower() or "timeout" in msg.lower()
        path = self.dump(f"{entry.op} #{entry.seq} on {entry.group} failed")
        where = (
            f"rank {self.rank}: {entry.op} #{entry.seq} on group {entry.group} "
            f"(shapes {entry.shapes}, {entry.dtype})"
        )
        if timed_out:
            return CollectiveTimeoutError(
                f"{where} did not complete within the timeout of {group_timeout_s:g} s while "
                f"waiting for the other ranks of the group; trace written to {path}. Cause: {msg}"
            )
        return CollectiveError(f"{where} failed; trace written to {path}. Cause: {msg}")


def check_same_call(
    pg: dist.ProcessGroup | None,
    group_name: str,
    group_ranks: tuple[int, ...],
    seq: int,
    desc: str,
    device: torch.device,
) -> None:
    """Debug mode: every rank of the group exchanges a fingerprint of call number ``seq`` it is
    about to make; any difference raises DesyncError on every rank instead of a hang or garbage.
    """
    text = f"#{seq} {desc}".encode()[:DESC_BYTES]
    mine = torch.zeros(DESC_BYTES, dtype=torch.uint8, device=device)
    mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    theirs = [torch.empty_like(mine) for _ in group_ranks]
    dist.all_gather(theirs, mine, group=pg)
    calls = [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in theirs]
    torch_ranks = sorted(group_ranks)
    if len(set(calls)) > 1:
        first = calls[0]
        other = next(i for i, c in enumerate(calls) if c != first)
        raise DesyncError(
            f"collective desync in group {group_name}: rank {torch_ranks[0]} issued "
            f"'{first}' but rank {torch_ranks[other]} issued '{calls[other]}'. "
            f"All calls: " + "; ".join(f"rank {r}: {c}" for r, c in zip(torch_ranks, calls))
        )

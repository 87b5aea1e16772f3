"""Flight recorder for collectives, and the debug-mode check that ranks issue the same calls.

Each rank keeps its last ``TRACE_LEN`` collectives. When one fails (a timeout, a peer that died),
the rank writes the trace to stderr and to ``$SHARDWISE_TRACE_DIR/shardwise-trace-rank{R}.txt``
(default: the system temp dir), so a user sees which rank stopped where.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import dist as sw_dist

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


_trace: collections.deque[TraceEntry] = collections.deque(maxlen=TRACE_LEN)
_seq: dict[str, int] = collections.defaultdict(int)
_debug_override: bool | None = None


def debug_enabled() -> bool:
    if _debug_override is not None:
        return _debug_override
    return os.environ.get("SHARDWISE_DEBUG_COLLECTIVES", "0") not in ("", "0", "false", "False")


def set_debug(enabled: bool | None) -> None:
    """Turn the desync check on or off (None: follow SHARDWISE_DEBUG_COLLECTIVES)."""
    global _debug_override
    _debug_override = enabled


def reset() -> None:
    _trace.clear()
    _seq.clear()


def begin(op: str, group_name: str, shapes: str, dtype: str) -> TraceEntry:
    _seq[group_name] += 1
    entry = TraceEntry(_seq[group_name], op, group_name, shapes, dtype, time.time())
    _trace.append(entry)
    return entry


def entries() -> list[TraceEntry]:
    return list(_trace)


def dump(reason: str) -> Path:
    """Write this rank's trace to stderr and to its file; returns the file."""
    rank = sw_dist.rank() if dist.is_initialized() else 0
    lines = [f"[shardwise rank {rank}] collective trace ({reason}), oldest first:"]
    lines += [f"  {e.line()}" for e in _trace]
    text = "\n".join(lines) + "\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    folder = Path(os.environ.get("SHARDWISE_TRACE_DIR", tempfile.gettempdir()))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"shardwise-trace-rank{rank}.txt"
    path.write_text(text)
    return path


def fail(entry: TraceEntry, group_timeout_s: float, exc: BaseException) -> CollectiveError:
    """Turn a transport exception into a shardwise error after writing the trace."""
    msg = str(exc)
    timed_out = "timed out" in msg.lower() or "timeout" in msg.lower()
    path = dump(f"{entry.op} #{entry.seq} on {entry.group} failed")
    rank = sw_dist.rank()
    if timed_out:
        return CollectiveTimeoutError(
            f"rank {rank}: {entry.op} #{entry.seq} on group {entry.group} (shapes {entry.shapes}, "
            f"{entry.dtype}) did not complete within the timeout of {group_timeout_s:g} s while "
            f"waiting for the other ranks of the group; trace written to {path}. Cause: {msg}"
        )
    return CollectiveError(
        f"rank {rank}: {entry.op} #{entry.seq} on group {entry.group} (shapes {entry.shapes}, "
        f"{entry.dtype}) failed; trace written to {path}. Cause: {msg}"
    )


def check_same_call(
    pg: dist.ProcessGroup,
    group_name: str,
    group_ranks: tuple[int, ...],
    desc: str,
    device: torch.device,
) -> None:
    """Debug mode: every rank of the group exchanges a fingerprint of the call it is about to
    make; any difference raises DesyncError on every rank instead of a hang or garbage."""
    seq = _seq[group_name] + 1
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

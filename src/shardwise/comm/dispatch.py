"""How every collective is issued: checked, traced, counted in its group's ``CommStats``, bounded
by its group's timeout, and waited for (now, or later through a ``Handle``)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from shardwise.comm import trace
from shardwise.comm.groups import Group

T = TypeVar("T")

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)


class Handle(Generic[T]):
    """An op in flight. ``wait()`` blocks until it is complete and returns its result."""

    def __init__(
        self,
        op: str,
        entry: trace.TraceEntry,
        group: Group,
        works: list[Any],
        finish: Callable[[], T],
        t0: float,
    ) -> None:
        self._op, self._entry, self._group = op, entry, group
        self._works, self._finish, self._t0 = works, finish, t0
        self._done = False
        self._result: T | None = None

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self._works)

    def _wait_timeout(self) -> tuple[datetime.timedelta, ...]:
        """gloo bounds its collectives by the group's timeout, but waits for a point-to-point
        message forever unless the wait itself is given one."""
        if self._op in ("send", "recv"):
            return (datetime.timedelta(seconds=self._group.timeout_s),)
        return ()

    def wait(self) -> T:
        if self._done:
            return self._result  # type: ignore[return-value]  # set below before _done
        blocked0 = time.perf_counter()
        try:
            for w in self._works:
                if w is not None:
                    w.wait(*self._wait_timeout())
        except Exception as exc:  # the transport's error: write the trace, say what hung
            raise self._group.tracer.fail(self._entry, self._group.timeout_s, exc) from exc
        self._result = self._finish()
        end = time.perf_counter()
        self._entry.end = time.time()
        self._group.stats.record_done(self._op, end - self._t0, end - blocked0)
        self._done = True
        return self._result


def check_tensor(t: torch.Tensor, what: str, op: str) -> None:
    """TypeError / ValueError naming the op when ``t`` cannot be sent as it is."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{op}: dtype {t.dtype} of {what} is not supported; allowed: {names}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {what} is not contiguous; pass {what}.contiguous()")


REDUCE_OPS: dict[str, Any] = {  # torch's ReduceOp members (typed RedOpType)
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def check_reduce(op: str, t: torch.Tensor, name: str) -> Any:
    """torch's ReduceOp for ``op`` (``avg`` is a sum, divided afterwards); ValueError /
    TypeError naming ``name`` for an unknown op or an average of integers."""
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: unknown reduce op {op!r}; allowed: {', '.join(REDUCE_OPS)}")
    check_tensor(t, "t", name)
    if op == "avg" and not t.is_floating_point():
        raise TypeError(f"{name}: op 'avg' needs a floating dtype, got {t.dtype}")
    return REDUCE_OPS[op]


def check_group(group: Group, op: str) -> Group:
    """The library passes a shardwise Group to every collective (None is for users only)."""
    if not isinstance(group, Group):
        raise TypeError(
            f"{op}: group must be a shardwise Group, got {type(group).__name__} "
            "(the public shardwise.comm functions also accept None for the world)"
        )
    return group


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def launch(
    op: str,
    group: Group,
    tensors: Sequence[torch.Tensor],
    payload_bytes: int,
    issue: Callable[[], list[Any]],
    finish: Callable[[], T],
    async_op: bool,
    extra: str = "",
    *,
    inter_node_bytes: int = 0,
) -> T | Handle[T]:
    """Trace, optionally desync-check, count, issue, and wait unless ``async_op``.
    ``inter_node_bytes``: what this rank sends to other nodes (``comm.crossing``)."""
    if not group.is_member:
        raise ValueError(f"{op}: this rank is not a member of {group}")
    shapes = ",".join(str(tuple(t.shape)) for t in tensors)
    dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else "-"
    # point-to-point messages are not collectives: no cross-rank check, their own sequence
    p2p = op in ("send", "recv")
    counter = group.p2p_calls if p2p else group.calls
    seq = counter.issued + 1
    if group.debug_enabled() and group.size > 1 and not p2p:
        desc = f"{op}({extra}shapes={shapes}, dtype={dtype})"
        dev = tensors[0].device if tensors else torch.device("cpu")
        trace.check_same_call(group.pg, group.name, group.ranks, seq, desc, dev)
    counter.issued = seq
    entry = group.tracer.begin(op, f"{group.name}.p2p" if p2p else group.name, seq, shapes, dtype)
    group.stats.record_launch(op, payload_bytes, inter_node_bytes)
    t0 = time.perf_counter()
    try:
        works = issue() if group.size > 1 else []
    except Exception as exc:
        raise group.tracer.fail(entry, group.timeout_s, exc) from exc
    handle = Handle(op, entry, group, works, finish, t0)
    return handle if async_op else handle.wait()

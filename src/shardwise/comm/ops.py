"""Every collective shardwise issues. Each call is traced, counted in ``STATS`` and bounded by
its group's timeout; gloo's missing pieces (avg, uneven reduce_scatter) are built here from
what gloo has.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import dist as sw_dist
from shardwise.comm import emulate, trace
from shardwise.comm.groups import Group, resolve
from shardwise.comm.stats import STATS

GroupLike = Group | ProcessGroup | None

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
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

P2P_TAG = 0x5357  # gloo slots for point-to-point collectives (apart from user send/recv)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An op in flight. ``wait()`` blocks until it is complete and returns its result."""

    def __init__(
        self,
        op: str,
        entry: trace.TraceEntry,
        group: Group,
        works: list[Any],
        finish: Callable[[], Any],
        t0: float,
    ) -> None:
        self._op, self._entry, self._group = op, entry, group
        self._works, self._finish, self._t0 = works, finish, t0
        self._done = False
        self._result: Any = None

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self._works)

    def _wait_timeout(self) -> tuple[datetime.timedelta, ...]:
        """gloo bounds its collectives by the group's timeout, but waits for a point-to-point
        message forever unless the wait itself is given one."""
        if self._op in ("send", "recv"):
            return (datetime.timedelta(seconds=self._group.timeout_s),)
        return ()

    def wait(self) -> Any:
        if self._done:
            return self._result
        blocked0 = time.perf_counter()
        try:
            for w in self._works:
                if w is not None:
                    w.wait(*self._wait_timeout())
        except Exception as exc:  # the transport's error: write the trace, say what hung
            raise trace.fail(self._entry, self._group.timeout_s, exc) from exc
        self._result = self._finish()
        end = time.perf_counter()
        self._entry.end = time.time()
        STATS.record_done(self._op, end - self._t0, end - blocked0)
        self._done = True
        return self._result


def _check_tensor(t: torch.Tensor, what: str, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{op}: dtype {t.dtype} of {what} is not supported; allowed: {names}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {what} is not contiguous; pass {what}.contiguous()")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _launch(
    op: str,
    group: Group,
    tensors: Sequence[torch.Tensor],
    nbytes: int,
    issue: Callable[[], list[Any]],
    finish: Callable[[], Any],
    async_op: bool,
    extra: str = "",
) -> Any:
    """Trace, optionally desync-check, count, issue, and wait unless ``async_op``."""
    if not group.is_member:
        raise ValueError(f"{op}: this rank is not a member of {group}")
    shapes = ",".join(str(tuple(t.shape)) for t in tensors)
    dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else "-"
    # point-to-point messages are not collectives: no cross-rank check, their own sequence
    p2p = op in ("send", "recv")
    if trace.debug_enabled() and group.size > 1 and not p2p:
        desc = f"{op}({extra}shapes={shapes}, dtype={dtype})"
        dev = tensors[0].device if tensors else torch.device("cpu")
        trace.check_same_call(group.pg, group.name, group.ranks, desc, dev)
    entry = trace.begin(op, f"{group.name}.p2p" if p2p else group.name, shapes, dtype)
    STATS.record_launch(op, nbytes)
    t0 = time.perf_counter()
    try:
        works = issue() if group.size > 1 else []
    except Exception as exc:
        raise trace.fail(entry, group.timeout_s, exc) from exc
    handle = Handle(op, entry, group, works, finish, t0)
    return handle if async_op else handle.wait()


def _reduce_op(op: str, name: str) -> dist.ReduceOp:
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: unknown reduce op {op!r}; allowed: {', '.join(REDUCE_OPS)}")
    return REDUCE_OPS[op]


def _finish_avg(t: torch.Tensor, op: str, size: int) -> Callable[[], torch.Tensor]:
    def finish() -> torch.Tensor:
        if op == "avg" and size > 1:
            t.div_(size)
        return t

    return finish


def all_reduce(
    t: torch.Tensor, op: str = "sum", group: GroupLike = None, async_op: bool = False
) -> torch.Tensor | Handle:
    """Reduce ``t`` in place across the group. ``avg`` on gloo is a sum then a division.

    Communicates: all_reduce of ``t`` (payload: t's bytes).
    """
    g = resolve(group)
    rop = _reduce_op(op, "all_reduce")
    _check_tensor(t, "t", "all_reduce")
    if op == "avg" and not t.is_floating_point():
        raise TypeError(f"all_reduce: op 'avg' needs a floating dtype, got {t.dtype}")
    return _launch(
        "all_reduce",
        g,
        [t],
        _nbytes(t),
        lambda: [dist.all_reduce(t, rop, group=g.pg, async_op=True)],
        _finish_avg(t, op, g.size),
        async_op,
        f"op={op}, ",
    )


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: str = "sum", group: GroupLike = None
) -> list[torch.Tensor]:
    """All-reduce many small tensors as one flat buffer per dtype (one collective each), then
    copy the results back in place. Communicates: one all_reduce per dtype present."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        all_reduce(flat, op=op, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return list(tensors)


def broadcast(
    t: torch.Tensor, src: int = 0, group: GroupLike = None, async_op: bool = False
) -> torch.Tensor | Handle:
    """Copy ``t`` from global rank ``src`` to every rank of the group, in place.

    Communicates: broadcast of ``t`` (payload: t's bytes)."""
    g = resolve(group)
    _check_tensor(t, "t", "broadcast")
    if src not in g.ranks:
        raise ValueError(f"broadcast: src rank {src} is not in {g}; allowed: {list(g.ranks)}")
    return _launch(
        "broadcast",
        g,
        [t],
        _nbytes(t),
        lambda: [dist.broadcast(t, src, group=g.pg, async_op=True)],
        lambda: t,
        async_op,
        f"src={src}, ",
    )


def all_gather(
    t: torch.Tensor,
    group: GroupLike = None,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | Handle:
    """Concatenate every rank's ``t`` along dim 0 in group-rank order (a 0-d tensor counts as
    one element). Every rank must pass the same shape; ``t`` may be this rank's chunk of
    ``out``.

    Communicates: all_gather (payload: the gathered output's bytes)."""
    g = resolve(group)
    _check_tensor(t, "t", "all_gather")
    src = t.reshape(1) if t.dim() == 0 else t
    shape = (g.size * src.shape[0], *src.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
    elif tuple(out.shape) != shape or out.dtype != t.dtype:
        raise ValueError(
            f"all_gather: out must have shape {shape} and dtype {t.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    elif not out.is_contiguous():
        raise ValueError("all_gather: out is not contiguous")
    if g.size > 1 and dist.get_backend(g.pg) == "gloo" and _nbytes(out) >= P2P_ALL_GATHER_MIN_BYTES:
        return _all_gather_p2p(g, src, out, async_op, t)
    target = torch.empty_like(out) if g.permuted else out
    if g.size > 1 and src.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        src = src.clone()  # the input is a slice of the output: not every backend allows that

    def issue() -> list[Any]:
        return [_all_gather_single(target, src, group=g.pg, async_op=True)]

    def finish() -> torch.Tensor:
        if g.size == 1:
            out.copy_(src)
        elif g.permuted:
            chunks = target.chunk(g.size)
            for i in range(g.size):
                out.chunk(g.size)[i].copy_(chunks[g.torch_position(i)])
        return out

    return _launch("all_gather", g, [t], _nbytes(out), issue, finish, async_op)


P2P_ALL_GATHER_MIN_BYTES = 4 << 20  # below this, gloo's own all_gather is as fast


def _all_gather_p2p(
    g: Group, src: torch.Tensor, out: torch.Tensor, async_op: bool, t: torch.Tensor
) -> torch.Tensor | Handle:
    """all_gather on gloo from isend/irecv straight into ``out``'s chunks: gloo's ring
    all_gather slows down on large messages, a direct exchange does not."""
    me = g.rank
    parts = out.chunk(g.size)

    def issue() -> list[Any]:
        works = []
        for j in range(g.size):
            if j != me:
                works.append(dist.isend(src, g.ranks[j], group=g.pg, tag=P2P_TAG + 1))
                works.append(dist.irecv(parts[j], g.ranks[j], group=g.pg, tag=P2P_TAG + 1))
        return works

    def finish() -> torch.Tensor:
        if parts[me].data_ptr() != src.data_ptr():
            parts[me].copy_(src)
        return out

    return _launch("all_gather", g, [t], _nbytes(out), issue, finish, async_op)


def all_gather_list(t: torch.Tensor, group: GroupLike = None) -> list[torch.Tensor]:
    """Every rank's ``t`` as a list in group-rank order (one all_gather)."""
    g = resolve(group)
    full = all_gather(t, group=g)
    return [c.reshape(t.shape) for c in full.chunk(g.size)]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``n`` rows split into ``parts`` chunks as ``torch.tensor_split`` does: the first
    ``n % parts`` chunks are one longer."""
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def reduce_scatter(
    t: torch.Tensor,
    op: str = "sum",
    group: GroupLike = None,
    async_op: bool = False,
    out: torch.Tensor | None = None,
    inplace_ok: bool = False,
) -> torch.Tensor | Handle:
    """Reduce ``t`` across the group and return this rank's chunk of dim 0 (chunks as
    ``torch.tensor_split``: sizes need not divide).

    On gloo, whose reduce_scatter runs a full all_reduce internally, each rank sends every other
    rank the chunk that rank owns and sums what it receives (in group-rank order): (N-1)/N of the
    tensor leaves each rank, half of what an all_reduce moves. ``inplace_ok=True`` is accepted
    for callers that no longer need ``t`` (``out`` may then alias this rank's chunk of ``t``).
    Communicates: reduce_scatter (payload: the unreduced input's bytes).
    """
    g = resolve(group)
    rop = _reduce_op(op, "reduce_scatter")
    _check_tensor(t, "t", "reduce_scatter")
    if op == "avg" and not t.is_floating_point():
        raise TypeError(f"reduce_scatter: op 'avg' needs a floating dtype, got {t.dtype}")
    src = t.reshape(-1) if t.dim() == 0 else t
    sizes = chunk_sizes(src.shape[0], g.size)
    offsets = [sum(sizes[:i]) for i in range(g.size)]
    mine, rest = sizes[g.rank], src.shape[1:]
    if out is None:
        out = torch.empty((mine, *rest), dtype=t.dtype, device=t.device)
    elif tuple(out.shape) != (mine, *rest) or out.dtype != t.dtype:
        raise ValueError(
            f"reduce_scatter: out must have shape {(mine, *rest)} and dtype "
            f"{t.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    chunks = [src[offsets[i] : offsets[i] + sizes[i]] for i in range(g.size)]
    if g.size > 1 and dist.get_backend(g.pg) == "gloo":
        return _reduce_scatter_p2p(g, op, chunks, out, async_op, src)
    even = len(set(sizes)) == 1 and not g.permuted
    if even:
        staged, recv = src, out
    else:  # lay chunk i into slot torch_position(i) of a padded buffer, zero elsewhere
        width = sizes[0]
        staged = src.new_zeros((g.size * width, *rest))
        for i in range(g.size):
            p = g.torch_position(i)
            staged[p * width : p * width + sizes[i]].copy_(chunks[i])
        recv = src.new_empty((width, *rest))

    def issue() -> list[Any]:
        return [_reduce_scatter_single(recv, staged, op=rop, group=g.pg, async_op=True)]

    def finish() -> torch.Tensor:
        if g.size == 1:
            if out.data_ptr() != src.data_ptr():
                out.copy_(src)
        elif recv is not out:
            out.copy_(recv[:mine])
        return _finish_avg(out, op, g.size)()

    return _launch("reduce_scatter", g, [t], _nbytes(t), issue, finish, async_op, f"op={op}, ")


def _reduce_scatter_p2p(
    g: Group,
    op: str,
    chunks: list[torch.Tensor],
    out: torch.Tensor,
    async_op: bool,
    src: torch.Tensor,
) -> torch.Tensor | Handle:
    """reduce_scatter on gloo from isend/irecv: chunk j goes to group rank j."""
    me = g.rank
    # Two ranks: the peer's chunk can land straight in ``out`` (one add, no extra buffer)
    # unless ``out`` is this rank's own chunk of the input.
    direct = (
        g.size == 2
        and out.data_ptr() != chunks[me].data_ptr()
        and out.is_contiguous()
        and op in ("sum", "avg")
    )
    received = {
        j: (out if direct else torch.empty_like(chunks[me])) for j in range(g.size) if j != me
    }

    def issue() -> list[Any]:
        works = []
        for j in range(g.size):
            if j != me:
                works.append(dist.isend(chunks[j], g.ranks[j], group=g.pg, tag=P2P_TAG))
                works.append(dist.irecv(received[j], g.ranks[j], group=g.pg, tag=P2P_TAG))
        return works

    def finish() -> torch.Tensor:
        # group-rank order, accumulated in ``out`` (which may alias this rank's chunk: the
        # first elementwise op reads it before writing)
        if direct:  # a + b == b + a exactly: the same result as the general order
            out.add_(chunks[me])
            return _finish_avg(out, op, g.size)()
        parts = [chunks[me] if j == me else received[j] for j in range(g.size)]
        combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[
            op
        ]
        # accumulating into ``out`` is safe unless it aliases a part read after the first op
        late_alias = me >= 2 and out.data_ptr() == chunks[me].data_ptr()
        acc = torch.empty_like(out) if late_alias else out
        combine(parts[0], parts[1], out=acc)
        for part in parts[2:]:
            combine(acc, part, out=acc)
        if acc is not out:
            out.copy_(acc)
        return _finish_avg(out, op, g.size)()

    return _launch("reduce_scatter", g, [src], _nbytes(src), issue, finish, async_op, f"op={op}, ")


def send(
    t: torch.Tensor, dst: int, group: GroupLike = None, async_op: bool = False
) -> Handle | None:
    """Send ``t`` to global rank ``dst``. Communicates: t's bytes."""
    g = resolve(group)
    _check_tensor(t, "t", "send")
    if dst not in g.ranks or dst == g.ranks[g.rank]:
        raise ValueError(f"send: dst {dst} must be another rank of {g}")

    def issue() -> list[Any]:
        emulate.delay_send(g.ranks[g.rank], dst, _nbytes(t), sw_dist.world_size())
        return [dist.isend(t, dst, group=g.pg)]

    res = _launch("send", g, [t], _nbytes(t), issue, lambda: None, async_op)
    return res if async_op else None


def recv(
    t: torch.Tensor, src: int, group: GroupLike = None, async_op: bool = False
) -> torch.Tensor | Handle:
    """Receive into ``t`` from global rank ``src``. Communicates: t's bytes."""
    g = resolve(group)
    _check_tensor(t, "t", "recv")
    if src not in g.ranks or src == g.ranks[g.rank]:
        raise ValueError(f"recv: src {src} must be another rank of {g}")
    return _launch(
        "recv", g, [t], _nbytes(t), lambda: [dist.irecv(t, src, group=g.pg)], lambda: t, async_op
    )


def barrier(group: GroupLike = None) -> None:
    """Wait for every rank of the group (gloo names the ranks that did not arrive)."""
    import datetime

    g = resolve(group)

    def issue() -> list[Any]:
        if dist.get_backend(g.pg) == "gloo":
            dist.monitored_barrier(
                g.pg, timeout=datetime.timedelta(seconds=g.timeout_s), wait_all_ranks=True
            )
            return []
        return [dist.barrier(group=g.pg, async_op=True)]

    _launch("barrier", g, [], 0, issue, lambda: None, False)


def _object_tensor(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def broadcast_object(obj: Any, src: int = 0, group: GroupLike = None) -> Any:
    """Pickle ``obj`` on ``src`` and return it on every rank (two broadcasts: length, bytes)."""
    g = resolve(group)
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if g.pg is not None and dist.get_backend(g.pg) == "nccl"
        else torch.device("cpu")
    )
    is_src = g.ranks[g.rank] == src
    payload = _object_tensor(obj).to(dev) if is_src else None
    length = torch.tensor([payload.numel() if payload is not None else 0], device=dev)
    broadcast(length, src=src, group=g)
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    broadcast(payload, src=src, group=g)
    return obj if is_src else pickle.loads(payload.cpu().numpy().tobytes())


def all_gather_object(obj: Any, group: GroupLike = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order (two all_gathers: lengths, bytes)."""
    g = resolve(group)
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if g.pg is not None and dist.get_backend(g.pg) == "nccl"
        else torch.device("cpu")
    )
    payload = _object_tensor(obj).to(dev)
    lengths = all_gather(torch.tensor([payload.numel()], device=dev), group=g).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    full = all_gather(padded.unsqueeze(0), group=g).cpu()
    return [pickle.loads(full[i, : lengths[i]].numpy().tobytes()) for i in range(g.size)]

"""Point-to-point messages between pipeline stages, through the counted comm layer.

Each step, the first activation crossing a stage boundary is preceded by its shape and dtype
(one small int64 message); the receiver allocates from it, and every later micro-batch of the
step is checked against it on the sending side. Gradients go back with the shape the sender of
the activation already knows. Under ``SHARDWISE_DEBUG_COLLECTIVES=1`` every message is preceded
by a header (step, micro-batch, stage, kind, shape); a receiver that gets another message than
the one its schedule expects raises ``DesyncError`` naming both ranks instead of hanging or
reading garbage.

Sends are asynchronous; the sender keeps each payload alive until its send completes and then
drops it (``release_completed``), so an activation is freed as soon as it has left. A receive can
be posted ahead of the action that takes it (``post_recv``): the transport moves a message only
once its receive is posted, so a receive posted while this rank computes has its payload in
place when the action comes, instead of one round trip after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise import comm
from shardwise.comm import ops, trace

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
META_LEN = 10  # ndim, dtype code, up to 8 dims
HEADER_LEN = 6 + 8  # step, mb, stage, kind, ndim, dtype code, up to 8 dims
KINDS = ("activation", "gradient")


def _describe(h: list[int]) -> str:
    step, mb, stage, kind, ndim, code = h[:6]
    dtype = str(DTYPES[code]).replace("torch.", "") if 0 <= code < len(DTYPES) else f"?{code}"
    return (
        f"{KINDS[kind] if kind in (0, 1) else kind} of stage {stage}, micro-batch {mb}, step "
        f"{step}, shape {tuple(h[6 : 6 + ndim])} {dtype}"
    )


@dataclass
class Channel:
    """This rank's messages with its pp peers for one executor (state kept across steps)."""

    group: comm.Group
    step: int = 0
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    announced: set[int] = field(default_factory=set)  # boundaries whose shape went this step
    pending: list[tuple[comm.Handle, list[torch.Tensor]]] = field(default_factory=list)
    # (kind, stage, micro-batch) -> a receive posted ahead of its action, and its buffer
    posted: dict[tuple[int, int, int], tuple[comm.Handle, torch.Tensor]] = field(
        default_factory=dict
    )

    def begin_step(self, step: int) -> None:
        self.step = step
        self.announced.clear()
        self.posted.clear()  # left only by a step that failed

    def _send(self, t: torch.Tensor, dst: int, keep: list[torch.Tensor]) -> None:
        handle = ops.send(t, dst, group=self.group, async_op=True)
        assert handle is not None
        self.pending.append((handle, [t, *keep]))

    def _header(self, mb: int, stage: int, kind: int, like: torch.Tensor) -> torch.Tensor:
        dims = list(like.shape) + [0] * (8 - like.dim())
        code = DTYPES.index(like.dtype)
        return torch.tensor([self.step, mb, stage, kind, like.dim(), code, *dims])

    def _check_header(self, expect: torch.Tensor, src: int) -> None:
        got = torch.empty(HEADER_LEN, dtype=torch.int64)
        ops.recv(got, src, group=self.group)
        if not torch.equal(got, expect):
            me = self.group.ranks[self.group.rank]
            raise trace.DesyncError(
                f"pipeline desync: rank {me} expected the {_describe(expect.tolist())} from rank "
                f"{src}, but rank {src} sent the {_describe(got.tolist())}"
            )

    def send_activation(self, t: torch.Tensor, stage: int, mb: int, dst: int) -> None:
        """Send stage ``stage``'s output of micro-batch ``mb`` to global rank ``dst``."""
        if t.dtype not in DTYPES or t.dim() > 8:
            raise TypeError(
                f"pipeline stage {stage} outputs {t.dtype} with {t.dim()} dims; a stage boundary "
                f"must be one floating tensor (allowed: {', '.join(map(str, DTYPES))}) of <= 8 dims"
            )
        t = t.contiguous()
        if stage not in self.announced:
            self.announced.add(stage)
            self.shapes[stage] = (tuple(t.shape), t.dtype)
            dims = list(t.shape) + [0] * (8 - t.dim())
            meta = torch.tensor([t.dim(), DTYPES.index(t.dtype), *dims], dtype=torch.int64)
            self._send(meta, dst, [])
        elif (tuple(t.shape), t.dtype) != self.shapes[stage]:
            shape, dtype = self.shapes[stage]
            raise ValueError(
                f"pipeline stage {stage} output of micro-batch {mb} is {tuple(t.shape)} {t.dtype},"
                f" but this step's first micro-batch sent {shape} {dtype} to rank {dst}; every "
                "micro-batch of a step must produce the same shape"
            )
        if self.group.debug_enabled():
            self._send(self._header(mb, stage, 0, t), dst, [])
        self._send(t, dst, [])

    def recv_activation(self, stage: int, mb: int, src: int) -> torch.Tensor:
        """Receive stage ``stage``'s output of micro-batch ``mb`` from global rank ``src``."""
        if stage not in self.announced:
            self.announced.add(stage)
            meta = torch.empty(META_LEN, dtype=torch.int64)
            ops.recv(meta, src, group=self.group)
            ndim, code, *dims = meta.tolist()
            self.shapes[stage] = (tuple(dims[:ndim]), DTYPES[code])
        return self._take(0, stage, mb, src)

    def send_gradient(self, g: torch.Tensor, stage: int, mb: int, dst: int) -> None:
        """Send the gradient of stage ``stage``'s input (micro-batch ``mb``) to ``dst``."""
        g = g.contiguous()
        if self.group.debug_enabled():
            self._send(self._header(mb, stage, 1, g), dst, [])
        self._send(g, dst, [])

    def recv_gradient(self, stage: int, mb: int, src: int) -> torch.Tensor:
        """Receive the gradient of stage ``stage - 1``'s output (micro-batch ``mb``)."""
        return self._take(1, stage, mb, src)

    def post_recv(self, kind: int, stage: int, mb: int, src: int) -> None:
        """Post now the receive that ``recv_activation`` (``kind`` 0) or ``recv_gradient``
        (1) of ``stage``, ``mb`` from ``src`` will take: only once this step's shape of the
        boundary is known (an activation's first needs its shape message first) and without
        headers (each is checked before its payload's receive is posted); else a no-op. It
        must be the next message from ``src``."""
        boundary = stage if kind == 0 else stage - 1
        key = (kind, stage, mb)
        if key in self.posted or boundary not in self.announced or self.group.debug_enabled():
            return
        shape, dtype = self.shapes[boundary]
        buf = torch.empty(shape, dtype=dtype)
        self.posted[key] = (ops.recv(buf, src, group=self.group, async_op=True), buf)

    def _take(self, kind: int, stage: int, mb: int, src: int) -> torch.Tensor:
        """The payload of a receive posted ahead, or received now."""
        ahead = self.posted.pop((kind, stage, mb), None)
        if ahead is not None:
            return ahead[0].wait()
        shape, dtype = self.shapes[stage if kind == 0 else stage - 1]
        buf = torch.empty(shape, dtype=dtype)
        if self.group.debug_enabled():
            self._check_header(self._header(mb, stage, kind, buf), src)
        ops.recv(buf, src, group=self.group)
        return buf

    def release_completed(self) -> None:
        """Drop the payloads whose sends are done (frees sent activations)."""
        keep = []
        for handle, tensors in self.pending:
            if handle.is_completed():
                handle.wait()  # returns at once; records the op as done
            else:
                keep.append((handle, tensors))
        self.pending = keep

    def wait_all(self) -> None:
        for handle, _ in self.pending:
            handle.wait()
        self.pending.clear()

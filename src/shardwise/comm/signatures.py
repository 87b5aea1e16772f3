"""Each tensor collective's call signature, written once.

``ops`` implements these (the group a required keyword at run time: library code names it) and
``facade`` serves the same functions with the group optional (None: the current world). The
overloads type ``async_op=True`` as returning a ``Handle``. ``group`` is typed ``GroupLike``
with a default so that one signature serves both; ``ops`` refuses anything but a ``Group`` at
run time, and a test checks that every library call names its group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeAlias, overload

import torch
from torch.distributed import ProcessGroup

from shardwise.comm.allreduce_rounds import GroupLinks
from shardwise.comm.dispatch import Handle
from shardwise.comm.groups import Group

GroupLike: TypeAlias = Group | ProcessGroup | None
"""What the public functions accept as ``group``: None (the current world), a shardwise
``Group`` or a torch ``ProcessGroup``."""

Tensor = torch.Tensor


def publish(fn: Callable[..., Any], name: str) -> Any:
    """``fn`` under its public ``name``, for a module-level name annotated with one of the
    signatures below (``send: Send = publish(_send, "send")``): mypy then types its calls by
    the signature's overloads."""
    fn.__name__ = fn.__qualname__ = name
    return fn


class AllReduce(Protocol):
    @overload
    def __call__(
        self,
        t: Tensor,
        op: str = ...,
        *,
        group: GroupLike = ...,
        async_op: Literal[False] = ...,
        algorithm: str = ...,
        nodes: Sequence[int] | None = ...,
        links: GroupLinks | None = ...,
    ) -> Tensor: ...
    @overload
    def __call__(
        self,
        t: Tensor,
        op: str = ...,
        *,
        group: GroupLike = ...,
        async_op: Literal[True],
        algorithm: str = ...,
        nodes: Sequence[int] | None = ...,
        links: GroupLinks | None = ...,
    ) -> Handle[Tensor]: ...
    @overload
    def __call__(
        self,
        t: Tensor,
        op: str = ...,
        *,
        group: GroupLike = ...,
        async_op: bool,
        algorithm: str = ...,
        nodes: Sequence[int] | None = ...,
        links: GroupLinks | None = ...,
    ) -> Tensor | Handle[Tensor]: ...


class Broadcast(Protocol):
    @overload
    def __call__(
        self, t: Tensor, src: int = ..., *, group: GroupLike = ..., async_op: Literal[False] = ...
    ) -> Tensor: ...
    @overload
    def __call__(
        self, t: Tensor, src: int = ..., *, group: GroupLike = ..., async_op: Literal[True]
    ) -> Handle[Tensor]: ...
    @overload
    def __call__(
        self, t: Tensor, src: int = ..., *, group: GroupLike = ..., async_op: bool
    ) -> Tensor | Handle[Tensor]: ...


class AllGather(Protocol):
    @overload
    def __call__(
        self,
        t: Tensor,
        *,
        group: GroupLike = ...,
        async_op: Literal[False] = ...,
        out: Tensor | None = ...,
    ) -> Tensor: ...
    @overload
    def __call__(
        self,
        t: Tensor,
        *,
        group: GroupLike = ...,
        async_op: Literal[True],
        out: Tensor | None = ...,
    ) -> Handle[Tensor]: ...
    @overload
    def __call__(
        self, t: Tensor, *, group: GroupLike = ..., async_op: bool, out: Tensor | None = ...
    ) -> Tensor | Handle[Tensor]: ...


class ReduceScatter(Protocol):
    @overload
    def __call__(
        self,
        t: Tensor,
        op: str = ...,
        *,
        group: GroupLike = ...,
        async_op: Literal[False] = ...,
        out: Tensor | None = ...,
    ) -> Tensor: ...
    @overload
    def __call__(
        self,
        t: Tensor,
        op: str = ...,
        *,
        group: GroupLike = ...,
        async_op: Literal[True],
        out: Tensor | None = ...,
    ) -> Handle[Tensor]: ...
    @overload
    def __call__(
        self,
        t: Tensor,
        op: str = ...,
        *,
        group: GroupLike = ...,
        async_op: bool,
        out: Tensor | None = ...,
    ) -> Tensor | Handle[Tensor]: ...


class AllToAll(Protocol):
    @overload
    def __call__(
        self, t: Tensor, *, group: GroupLike = ..., async_op: Literal[False] = ...
    ) -> Tensor: ...
    @overload
    def __call__(
        self, t: Tensor, *, group: GroupLike = ..., async_op: Literal[True]
    ) -> Handle[Tensor]: ...
    @overload
    def __call__(
        self, t: Tensor, *, group: GroupLike = ..., async_op: bool
    ) -> Tensor | Handle[Tensor]: ...


class Send(Protocol):
    @overload
    def __call__(
        self, t: Tensor, dst: int, *, group: GroupLike = ..., async_op: Literal[False] = ...
    ) -> None: ...
    @overload
    def __call__(
        self, t: Tensor, dst: int, *, group: GroupLike = ..., async_op: Literal[True]
    ) -> Handle[None]: ...
    @overload
    def __call__(
        self, t: Tensor, dst: int, *, group: GroupLike = ..., async_op: bool
    ) -> Handle[None] | None: ...


class Recv(Protocol):
    @overload
    def __call__(
        self, t: Tensor, src: int, *, group: GroupLike = ..., async_op: Literal[False] = ...
    ) -> Tensor: ...
    @overload
    def __call__(
        self, t: Tensor, src: int, *, group: GroupLike = ..., async_op: Literal[True]
    ) -> Handle[Tensor]: ...
    @overload
    def __call__(
        self, t: Tensor, src: int, *, group: GroupLike = ..., async_op: bool
    ) -> Tensor | Handle[Tensor]: ...


class AllReduceCoalesced(Protocol):
    def __call__(
        self, tensors: Sequence[Tensor], op: str = ..., *, group: GroupLike = ...
    ) -> list[Tensor]: ...


class AllGatherList(Protocol):
    def __call__(self, t: Tensor, *, group: GroupLike = ...) -> list[Tensor]: ...


class Barrier(Protocol):
    def __call__(self, *, group: GroupLike = ...) -> None: ...

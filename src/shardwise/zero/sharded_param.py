"""Stage-3 parameters that refuse to be read while they hold no values.

Between uses a stage-3 parameter's ``.data`` is a placeholder of its shape (see ``FlatParam``):
reading it would give a number that is not the parameter. The engine turns each such parameter
into a :class:`ShardedParameter`, a ``nn.Parameter`` whose torch functions check first that its
values are there. Metadata (shape, dtype, device, ``requires_grad``, ``grad``) stays readable
at any time; any operation on its values outside forward and backward raises, naming the
parameter and the supported ways to read it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class ValueHolder(Protocol):
    """Where a sharded parameter's values live (a ``FlatParam``)."""

    @property
    def holds_values(self) -> bool: ...


# What may be asked of a parameter whose values are not there: its metadata, where its (empty)
# storage is, and its gradient.
def _accessors(kind: str, *names: str) -> set[Any]:
    """The ``__get__`` / ``__set__`` of Tensor properties, as torch functions see them."""
    return {getattr(inspect.getattr_static(Tensor, n), f"__{kind}__") for n in names}


_METADATA: set[Any] = {
    *_accessors("get", "shape", "dtype", "device", "layout", "ndim", "is_leaf", "grad_fn"),
    *_accessors("get", "is_cuda", "is_meta", "requires_grad", "grad", "_grad"),
    *_accessors("set", "requires_grad", "grad", "_grad", "data"),
    Tensor.size,
    Tensor.stride,
    Tensor.storage_offset,
    Tensor.is_contiguous,
    Tensor.untyped_storage,  # memory accounting: the placeholder's one element, no values read
    Tensor.data_ptr,
    Tensor.dim,
    Tensor.numel,
    Tensor.nelement,
    Tensor.element_size,
    Tensor.is_floating_point,
    Tensor.is_complex,
    Tensor.requires_grad_,
    Tensor.register_hook,
    Tensor.register_post_accumulate_grad_hook,
    Tensor.retain_grad,
    Tensor.__hash__,
    # names the parameters whose gradients to compute (a pipeline's weight-gradient pass);
    # the values backward reads come through saved tensors, which the schedule gathers
    torch.autograd.backward,
}


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter (made by the engine, never by users): usable in forward and
    backward, and inside ``engine.gathered_parameters()``; reading its values elsewhere raises
    ``RuntimeError``."""

    _sw_flat: ValueHolder
    _sw_name: str

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            released = _first_released(args, kwargs)
            if released is not None:
                if func is Tensor.__repr__:
                    return _describe(released)
                raise RuntimeError(_message(released, func))
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


def make_sharded(param: nn.Parameter, name: str, flat: ValueHolder) -> None:
    """Turn the engine's ``param`` (named ``name`` in the model) into a ShardedParameter whose
    values live in ``flat``."""
    param.__class__ = ShardedParameter
    param._sw_flat = flat  # type: ignore[attr-defined]
    param._sw_name = name  # type: ignore[attr-defined]


def _released(value: Any) -> bool:
    if type(value) is not ShardedParameter:
        return False
    flat = getattr(value, "_sw_flat", None)  # a copy made inside gathered_parameters has none
    return flat is not None and not flat.holds_values


def call_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    """The arguments of a torch function call, with the items of list and tuple arguments."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _first_released(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return next((v for v in call_args(args, kwargs) if _released(v)), None)


def _name_of(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a property read, e.g. ``p.data``
        owner = getattr(func, "__self__", None)
        return f"reading .{getattr(owner, '__name__', '?')}"
    return f"{name}()"


def _message(param: Any, func: Callable[..., Any]) -> str:
    return (
        f"parameter {param._sw_name!r} is sharded (ZeRO stage 3): between forward and backward "
        f"it holds no values ({_name_of(func)} needs them). Read full parameters inside "
        f"`with engine.gathered_parameters():`, or take engine.state_dict()"
    )


def _describe(param: Any) -> str:
    return (
        f"ShardedParameter({param._sw_name!r}, shape={tuple(param.shape)}, dtype={param.dtype}: "
        f"sharded, values only inside engine.gathered_parameters())"
    )

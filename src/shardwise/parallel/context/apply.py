"""Context parallelism applied to a model from outside, by a plan of module-name patterns.

Styles (``STYLES``):

- ``sdpa``: a module whose forward calls ``torch.nn.functional.scaled_dot_product_attention``
  (the built-in GPT's attention): while it runs, that call becomes exact attention over the
  cp axis (a torch function mode entered and left by the module's hooks; nothing is patched).
- ``hf_attention``: a Hugging Face attention module (``LlamaAttention``): the model's attention
  implementation becomes shardwise's, registered with ``transformers.AttentionInterface``;
  it takes the padding from the batch (``ContextParallel.split``), so the model builds no mask.
- ``positions``: a module fed the positions of its input's tokens (a position embedding, a
  rotary embedding's ``position_ids``): positions ``0..n-1``, which is what a model derives
  from this rank's ``n`` tokens, become this rank's global positions; any others are the
  caller's and pass as given.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.mesh import Axis, Mesh
from shardwise.parallel.context.attention import ContextParallel
from shardwise.parallel.tensor.plan import expand, unmatched_error

STYLES = ("sdpa", "hf_attention", "positions")
HF_IMPLEMENTATION = "shardwise_context"
_BOUND: weakref.WeakKeyDictionary[nn.Module, tuple[ContextParallel, str]] = (
    weakref.WeakKeyDictionary()
)


class _SdpaMode(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to the cp attention while a module runs."""

    def __init__(self, cp: ContextParallel, name: str) -> None:
        super().__init__()
        self.cp, self.name = cp, name

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        q, k, v, *rest = args
        opts = {**dict(zip(names, rest)), **kwargs}
        if opts.get("attn_mask") is not None or opts.get("dropout_p", 0.0):
            raise ValueError(
                f"{self.name}: context-parallel attention takes no attn_mask (give the padding "
                "to ContextParallel.split) and no attention dropout"
            )
        return self.cp.attention(
            q, k, v, causal=bool(opts.get("is_causal")), scale=opts.get("scale"), where=self.name
        )


def _bind_sdpa(module: nn.Module, name: str, cp: ContextParallel) -> None:
    modes: list[_SdpaMode] = []

    def enter(mod: nn.Module, args: Any) -> None:
        modes.append(_SdpaMode(cp, name))
        modes[-1].__enter__()

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        if modes:
            modes.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function shardwise registers with transformers: [b, h, s/cp, d] in,
    [b, s/cp, h, d] out (what the model's attention modules expect)."""
    bound = _BOUND.get(module)
    if bound is None:
        raise ValueError(
            f"a {type(module).__name__} runs with attention implementation "
            f"{HF_IMPLEMENTATION!r} but was not given context parallelism by parallelize"
        )
    cp, name = bound
    if dropout:
        raise ValueError(f"{name}: context-parallel attention runs without attention dropout")
    causal = bool(getattr(module, "is_causal", True))
    out = cp.attention(query, key, value, causal=causal, scale=scaling, where=name)
    return out.transpose(1, 2).contiguous(), None


def _bind_hf(module: nn.Module, name: str, cp: ContextParallel) -> None:
    from transformers import AttentionInterface

    config = getattr(module, "config", None)
    if config is None:
        raise TypeError(f"module {name!r} has no Hugging Face config: style 'hf_attention'")
    AttentionInterface.register(HF_IMPLEMENTATION, _hf_attention)
    config._attn_implementation = HF_IMPLEMENTATION
    _BOUND[module] = (cp, name)


def _global_positions(cp: ContextParallel, pos: torch.Tensor) -> torch.Tensor:
    n = pos.shape[-1]
    local = torch.arange(n, device=pos.device, dtype=pos.dtype)
    if pos.is_floating_point() or not bool((pos == local).all()):
        return pos
    return cp.layout.positions(n, pos.device).to(pos.dtype).expand_as(pos)


def _bind_positions(module: nn.Module, cp: ContextParallel) -> None:
    def remap(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(kwargs.get("position_ids"), torch.Tensor):
            return args, {**kwargs, "position_ids": _global_positions(cp, kwargs["position_ids"])}
        if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            return (_global_positions(cp, args[0]), *args[1:]), kwargs
        if len(args) > 1 and isinstance(args[1], torch.Tensor):  # (hidden, position_ids)
            return (args[0], _global_positions(cp, args[1]), *args[2:]), kwargs
        return args, kwargs

    module.register_forward_pre_hook(remap, with_kwargs=True)


def apply_context_parallel(
    model: nn.Module,
    mesh: Mesh,
    plan: Mapping[str, str],
    method: str,
    unmatched: list[str] | None = None,
) -> ContextParallel:
    """Give ``model``'s modules named by ``plan`` ({pattern: style}) context parallelism over
    the mesh's cp axis with ``method`` (``ring`` or ``all_to_all``). Patterns matching no module
    raise, or with ``unmatched`` are appended to it (a pipeline stage holds some layers)."""
    cp = ContextParallel(mesh.group(Axis.CP), method)
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"context plan[{pattern!r}] = {style!r}: allowed styles are {STYLES}")
        matched = [
            n for n in modules if n and any(fnmatch.fnmatchcase(n, p) for p in expand(pattern))
        ]
        if not matched:
            if unmatched is None:
                raise unmatched_error(pattern, style, model)
            unmatched.append(pattern)
        for name in matched:
            if style == "sdpa":
                _bind_sdpa(modules[name], name, cp)
            elif style == "hf_attention":
                _bind_hf(modules[name], name, cp)
            else:
                _bind_positions(modules[name], cp)
    return cp

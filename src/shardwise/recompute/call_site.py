"""Activation checkpointing at a call site: ``checkpoint(fn, *args)`` and
``checkpoint_sequential(modules, segments, x)``, thin layers over PyTorch's non-reentrant
``torch.utils.checkpoint.checkpoint``. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its intermediate activations.

    Only the inputs are kept; the tensors autograd would have saved inside ``fn`` are recomputed
    by running ``fn`` again during backward (non-reentrant checkpointing, so
    ``torch.autograd.grad``, inputs that do not require grad and nested outputs all work). The
    CPU RNG state and the RNG state of every CUDA device an input lives on are saved and restored
    for the recompute, so dropout draws the same masks. Every keyword argument goes to ``fn``.

    Args:
        fn: a deterministic function of its inputs (given the RNG state).
        *args: positional inputs of ``fn``.
        **kwargs: keyword inputs of ``fn``.

    Returns:
        Whatever ``fn`` returns.
    """
    names = tuple(kwargs)

    # Keyword values travel as positional inputs so that no name of ``fn`` can collide with an
    # option of torch's checkpoint, and so that tensors among them count as inputs for RNG
    # device detection.
    def call(*flat: Any) -> Any:
        split = len(flat) - len(names)
        return fn(*flat[:split], **dict(zip(names, flat[split:], strict=True)))

    return torch_checkpoint.checkpoint(
        call, *args, *kwargs.values(), use_reentrant=False, preserve_rng_state=True
    )


def _run_segment(part: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    for module in part:
        x = module(x)
    return x


def _segment_bounds(num_modules: int, segments: int) -> list[tuple[int, int]]:
    """Split ``range(num_modules)`` into ``segments`` runs whose sizes differ by at most one."""
    base, extra = divmod(num_modules, segments)
    bounds, start = [], 0
    for index in range(segments):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def checkpoint_sequential(
    modules: Sequence[nn.Module] | nn.Sequential,
    segments: int,
    x: torch.Tensor,
    *,
    checkpoint_last: bool = False,
) -> torch.Tensor:
    """Run ``x`` through ``modules`` in order, checkpointing them in ``segments`` segments.

    The modules are split into ``segments`` consecutive segments whose lengths differ by at most
    one (earlier segments take the extra module). Each segment but the last runs under
    `checkpoint`, keeping only its input. As in ``torch.utils.checkpoint.checkpoint_sequential``,
    the last segment runs normally by default: backward needs its activations first, so
    recomputing them would cost time without lowering peak memory. Pass ``checkpoint_last=True``
    to checkpoint it too (useful when a large loss head runs between forward and backward). With
    ``segments=1`` and the default, nothing is checkpointed.

    Args:
        modules: modules that each take and return one tensor.
        segments: number of segments, 1 to ``len(modules)``.
        x: input of the first module.
        checkpoint_last: also checkpoint the last segment.

    Returns:
        The output of the last module.
    """
    parts = list(modules)
    if not parts:
        raise ValueError("checkpoint_sequential needs at least one module; got an empty sequence")
    if (
        isinstance(segments, bool)
        or not isinstance(segments, int)
        or not 0 < segments <= len(parts)
    ):
        raise ValueError(
            f"segments={segments!r}: choose an int in 1..{len(parts)} "
            f"(at most one segment per module, {len(parts)} modules given)"
        )
    bounds = _segment_bounds(len(parts), segments)
    for index, (start, stop) in enumerate(bounds):
        part = tuple(parts[start:stop])
        if index == len(bounds) - 1 and not checkpoint_last:
            x = _run_segment(part, x)
        else:
            x = checkpoint(_run_segment, part, x)
    return x

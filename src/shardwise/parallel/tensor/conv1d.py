"""Linear layers stored transposed, fused projections and attention run on local heads.

A ``Conv1D`` (GPT-2's linear layer: ``y = x W + b`` with ``W`` stored ``[in, out]``) takes the
linear styles as an ``nn.Linear`` does, with the weight's dims swapped: column-parallel splits
dim 1 of the weight (and the bias), row-parallel dim 0 (its bias, replicated, is added once
after the sum over tp). It is recognised by its shape of attributes (``nf``, ``nx``, a 2-D
weight), so the library needs no model package.

``colwise_qkv`` is column-parallel over a fused projection whose output is three equal blocks
(q | k | v): each block is split over tp (``Shard(dim, blocks=3)``), so a rank's output is its
heads of q, then of k, then of v. The attention module that splits that output by its own
attributes is marked ``local_heads``: its head count and widths become this rank's.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.parallel.tensor.layers import ColumnParallelLinear, Region, RowParallelLinear

FUSED_BLOCKS = {"colwise_qkv": 3}
"""Column styles whose output is that many equal blocks, each split over tp."""

HEAD_COUNTS = ("num_heads",)
"""Attributes of a ``local_heads`` module counting heads (must divide by tp)."""

HEAD_WIDTHS = ("split_size", "embed_dim")
"""Attributes of a ``local_heads`` module giving widths of its heads together."""


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a ``Conv1D``: a linear layer whose weight is stored ``[in, out]``."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and hasattr(module, "nf")
        and hasattr(module, "nx")
    )


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return int(module.nx), int(module.nf)  # type: ignore[arg-type]
    assert isinstance(module, nn.Linear)
    return module.in_features, module.out_features


def weight_shape(module: nn.Module) -> tuple[int, int]:
    """The whole weight's shape as the module stores it."""
    n_in, n_out = features(module)
    return (n_in, n_out) if is_conv1d(module) else (n_out, n_in)


def params_of(module: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The layer's weight and bias (None when it has none)."""
    weight, bias = module.weight, getattr(module, "bias", None)
    assert isinstance(weight, nn.Parameter)
    return weight, bias if isinstance(bias, nn.Parameter) else None


def split_dims(module: nn.Module) -> tuple[int, int]:
    """``(input dim, output dim)`` of the module's weight."""
    return (0, 1) if is_conv1d(module) else (1, 0)


class _StoredTransposed:
    """A parallel linear layer over a ``Conv1D``: its weight is stored ``[in, out]``, and it
    answers to ``Conv1D``'s names for its widths."""

    weight: torch.Tensor
    in_features: int
    out_features: int

    @property
    def nx(self) -> int:
        return self.in_features

    @property
    def nf(self) -> int:
        return self.out_features

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()


class ColumnParallelConv1D(_StoredTransposed, ColumnParallelLinear):
    """A ``Conv1D`` split along its output features (weight dim 1, bias dim 0)."""

    OUT_DIM = 1


class RowParallelConv1D(_StoredTransposed, RowParallelLinear):
    """A ``Conv1D`` split along its input features (weight dim 0); bias added after the sum."""

    IN_DIM = 0


def column_layer(module: nn.Module, region: Region, full_out: int, gather: bool) -> nn.Module:
    """The column-parallel layer over ``module`` (an ``nn.Linear`` or a ``Conv1D``)."""
    layer = ColumnParallelConv1D if is_conv1d(module) else ColumnParallelLinear
    return layer(module, region, full_out, gather)


def row_layer(module: nn.Module, region: Region) -> nn.Module:
    """The row-parallel layer over ``module`` (an ``nn.Linear`` or a ``Conv1D``)."""
    layer = RowParallelConv1D if is_conv1d(module) else RowParallelLinear
    return layer(module, region)


def check_heads(name: str, module: nn.Module, tp_size: int) -> None:
    """Raise ValueError in one line naming ``module`` when it cannot run on 1/tp of its heads
    (no head count, or one that does not divide by tp)."""
    counts = [a for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int)]
    if not counts:
        raise ValueError(
            f"module {name!r} ({type(module).__name__}) has no head count {HEAD_COUNTS}: style "
            "'local_heads' needs an attention module that splits its projections by heads"
        )
    for a in (*counts, *HEAD_WIDTHS):
        value = getattr(module, a, None)
        if isinstance(value, int) and value % tp_size:
            raise ValueError(
                f"module {name!r}: {a}={value} is not divisible by tp={tp_size}; each tp rank "
                "runs whole heads"
            )


def localize_heads(module: nn.Module, tp_size: int) -> None:
    """Make ``module``'s head count and widths this rank's (divided by tp): its fused
    projection's local output then splits into this rank's q, k and v."""
    for a in (*HEAD_COUNTS, *HEAD_WIDTHS):
        value = getattr(module, a, None)
        if isinstance(value, int):
            setattr(module, a, value // tp_size)

"""Checks of a resolved tensor-parallel plan against a model, before anything is split."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardwise.parallel.tensor.conv1d import FUSED_BLOCKS, check_heads, features, split_dims
from shardwise.parallel.tensor.plan import LINEAR_STYLES, PLACE_STYLES


def validate(
    model: nn.Module, styles: dict[str, str], tp_size: int, sp: bool, carried: Mapping[str, str]
) -> None:
    """Check the whole plan before anything changes the model (``carried``: the LoRA layers,
    whose adapters are split with their bases)."""
    modules = dict(model.named_modules())
    vocabs = {modules[n].num_embeddings for n, s in styles.items() if s == "vocab_embedding"}
    # parameters sharded, or replicated inside a 'sequence' module, or adapters split to match
    covered = {id(p) for n in carried for p in modules[n].parameters()}
    for name, style in styles.items():
        m = modules[name]
        if style == "local_heads":
            check_heads(name, m, tp_size)
        if style in PLACE_STYLES:  # a place in the forward, not a way to hold parameters
            continue
        covered |= {id(p) for p in m.parameters()}
        if style not in LINEAR_STYLES:
            continue
        n_in, n_out = features(m)
        blocks = FUSED_BLOCKS.get(style, 1)
        if style == "rowwise" and n_in % tp_size:
            what = f"in_features={n_in}"
        elif style != "rowwise" and n_out % (tp_size * blocks):
            if n_out in vocabs and blocks == 1:
                continue
            what = f"out_features={n_out}"
            if blocks > 1:
                what = f"each of its {blocks} blocks ({n_out // blocks} of {what})"
        else:
            continue
        raise ValueError(
            f"module {name!r}: {what} is not divisible by tp={tp_size}; only a vocabulary "
            "(the size of a 'vocab_embedding' in the plan) may be padded"
        )
    _check_ties(modules, styles)
    if sp and tp_size > 1:
        for name, p in model.named_parameters():
            if id(p) not in covered:
                raise ValueError(
                    f"parameter {name!r} is replicated over tp but not inside a 'sequence' "
                    "module: under sequence parallelism its module sees 1/tp of the sequence; "
                    "add its module to the plan as 'sequence'"
                )


def _layouts(m: nn.Module, style: str) -> list[tuple[str, torch.Tensor, int | None]]:
    """(parameter name, parameter, split dim or None) that ``style`` gives ``m``'s params."""
    own = list(m.named_parameters(recurse=False))
    if style == "vocab_embedding":
        return [(n, p, 0) for n, p in own]
    if style in LINEAR_STYLES:  # the weight's input or output dim; a column bias: dim 0
        in_dim, out_dim = split_dims(m)
        if style == "rowwise":
            return [(n, p, in_dim if n == "weight" else None) for n, p in own]
        return [(n, p, out_dim if n == "weight" else 0) for n, p in own]
    if style in PLACE_STYLES:  # a place in the forward: its parameters are its children's
        return []
    return [(n, p, None) for n, p in m.named_parameters()]


def _check_ties(modules: Mapping[str, nn.Module], styles: Mapping[str, str]) -> None:
    """A parameter shared by two planned modules (a tied head) must be split the same way."""
    seen: dict[int, tuple[str, int | None]] = {}
    for name, style in styles.items():
        for pname, p, dim in _layouts(modules[name], style):
            first = seen.setdefault(id(p), (f"{name}.{pname}", dim))
            if first[1] != dim:
                raise ValueError(
                    f"parameter {first[0]!r} is tied into {name!r} ({style}) with another "
                    f"split: dim {first[1]} there, dim {dim} here (None: whole); tied layers "
                    "must split it the same way"
                )

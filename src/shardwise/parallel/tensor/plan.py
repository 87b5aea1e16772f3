"""Tensor-parallel plans: module-name glob patterns mapped to styles, resolved against a model.

Patterns are ``fnmatch`` globs over ``named_modules()`` names (``*`` also crosses dots) with
one level of ``{a,b,c}`` alternatives, e.g. ``"blocks.*.attn.{q,k,v}_proj"``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping

from torch import nn

from shardwise.parallel.tensor.adapters import base_of
from shardwise.parallel.tensor.conv1d import is_conv1d

STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather",
    "colwise_qkv",
    "vocab_embedding",
    "sequence",
    "sequence_entry",
    "whole_sequence",
    "local_heads",
)
"""colwise: Linear split on the output features (output stays split).
rowwise: Linear split on the input features (output summed over tp).
colwise_gather: colwise whose output is gathered to full width.
colwise_qkv: colwise over a fused projection whose output is three equal blocks (q | k | v),
    each split over tp: a rank's output is its heads of q, of k, then of v.
The linear styles take an ``nn.Linear`` or a ``Conv1D`` (weight stored ``[in, out]``).
vocab_embedding: Embedding split on the vocabulary (padded when it does not divide by tp).
sequence: a replicated module that runs inside a sequence-parallel region (norms, dropout).
sequence_entry: a module whose first positional input is the whole sequence (e.g. the first
    decoder layer of a model that derives positions and masks from the embedding's length):
    under sequence parallelism that input is split along the sequence as the module is entered
    (its other inputs stay whole), and the vocab embedding's output stays whole (all_reduce).
whole_sequence: a module whose own code needs the whole sequence (attention that reshapes its
    projections by its input's length): under sequence parallelism its first positional (or
    ``hidden_states``) input is gathered on entry, and its column-parallel layers take it as is.
local_heads: an attention module that splits a ``colwise_qkv`` output by its own attributes
    (``num_heads``, ``split_size``, ``embed_dim``): they become this rank's (divided by tp).
PLACE_STYLES (sequence_entry, whole_sequence, local_heads) mark places in the forward; the
parameters of such a module belong to its children's styles."""

PLACE_STYLES = ("sequence_entry", "whole_sequence", "local_heads")

LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather", "colwise_qkv")

_BRACES = re.compile(r"\{([^{}]*)\}")


def expand(pattern: str) -> list[str]:
    """``"a.{q,k}_proj"`` -> ``["a.q_proj", "a.k_proj"]`` (every brace group expanded)."""
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    out = []
    for alt in m.group(1).split(","):
        out.extend(expand(pattern[: m.start()] + alt.strip() + pattern[m.end() :]))
    return out


def _check_types(plan: object) -> Mapping[str, str]:
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must map module-name patterns to styles, got {type(plan).__name__}")
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"plan keys must be non-empty module-name patterns, got {pattern!r}")
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r}: allowed styles are {STYLES}")
    return plan


def _check_module(name: str, module: nn.Module, style: str) -> None:
    module = base_of(module)  # a LoRA layer: the style splits its base (and its adapters)
    if style in LINEAR_STYLES and not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}; style {style!r} needs an nn.Linear "
            "or a Conv1D"
        )
    if style == "vocab_embedding" and not isinstance(module, nn.Embedding):
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}; "
            "style 'vocab_embedding' needs an nn.Embedding"
        )


def unmatched_error(pattern: str, style: str, model: nn.Module) -> ValueError:
    """The error for a plan pattern that names no module of ``model``."""
    modules = dict(model.named_modules())
    return ValueError(
        f"plan pattern {pattern!r} ({style}) matches no module of "
        f"{type(model).__name__}; module names look like {_sample(modules)}"
    )


def resolve(
    model: nn.Module, plan: Mapping[str, str], unmatched: list[str] | None = None
) -> dict[str, str]:
    """``{module name: style}`` in model order; raises on a pattern matching no module, a module
    given two styles, or a module of the wrong type for its style. With ``unmatched`` (a list),
    patterns matching no module are appended to it instead of raising (a pipeline stage holds
    only some of the model's layers)."""
    _check_types(plan)
    modules = dict(model.named_modules())
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        matched = [
            name
            for name in modules
            if name and any(fnmatch.fnmatchcase(name, p) for p in expand(pattern))
        ]
        if not matched and unmatched is not None:
            unmatched.append(pattern)
        elif not matched:
            raise unmatched_error(pattern, style, model)
        for name in matched:
            if styles.get(name, style) != style:
                raise ValueError(
                    f"module {name!r} is given two styles: {styles[name]!r} and {style!r} "
                    f"(pattern {pattern!r})"
                )
            _check_module(name, modules[name], style)
            styles[name] = style
    return {name: styles[name] for name in modules if name in styles}


def _sample(modules: Mapping[str, nn.Module]) -> str:
    names = [n for n in modules if n][:6]
    return ", ".join(repr(n) for n in names) + (", ..." if len(modules) > 7 else "")

"""LoRA adapters on tensor-parallel layers.

A peft LoRA layer holds a ``base_layer`` and, per adapter, ``lora_A`` ``[r, in]`` and ``lora_B``
``[out, r]``; its forward is ``base(x) + B(A(dropout(x))) * scaling``. When a plan names such a
layer, its base is split as the style says and the adapters are split to match, so that the
result equals one process's:

- column-parallel base (``colwise``, ``colwise_gather``: output features split): A is whole on
  every rank and B is split on its output features like the base, as a column-parallel layer on
  A's ``r``-wide output. That layer's entry all-reduces the gradient of A's output in backward,
  so A's gradient (and the input gradient through A) is whole on every rank; with
  ``colwise_gather`` B's output is gathered like the base's.
- row-parallel base (``rowwise``: input features split, the input arrives split): A is split on
  its input features, as a row-parallel layer (its ``r``-wide partial outputs summed over tp);
  B is whole on every rank.

The dropout before A draws the same mask on every tp rank where its input is the same there
(the replicated stream), and from the rank's own stream where it differs (a row base's split
features; under sequence parallelism a column base's input outside a ``whole_sequence`` module,
this rank's tokens).

Under sequence parallelism the whole factor (A of a column base, B of a row base) sees 1/tp of
the tokens, or (A inside a ``whole_sequence`` module) a partial gradient: its placement is
``Replicate(partial=True)`` and a hook sums its gradient over tp. Only plain LoRA on linear
styles is split; anything else is refused naming the layer.

The layers are recognised by their attributes (``base_layer`` and a ``lora_A`` module dict), so
nothing here imports peft.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

CARRYING_STYLES = ("colwise", "rowwise", "colwise_gather")
"""The styles whose layers can carry LoRA adapters (split to match)."""


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (a ``base_layer`` with adapters around it)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def base_of(module: nn.Module) -> nn.Module:
    """The layer a plan style applies to: a LoRA layer's base, else ``module`` itself."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) and is_lora_layer(module) else module


def adapter_dicts(layer: nn.Module) -> dict[str, nn.ModuleDict]:
    """A LoRA layer's ``lora_A``, ``lora_B`` and ``lora_dropout`` (one entry per adapter)."""
    out = {n: getattr(layer, n, None) for n in ("lora_A", "lora_B", "lora_dropout")}
    return {n: d for n, d in out.items() if isinstance(d, nn.ModuleDict)}


def _variant(module: nn.Module) -> str | None:
    """The name of a LoRA variant the split does not cover, or None for plain LoRA."""
    if len(getattr(module, "lora_magnitude_vector", None) or ()):
        return "DoRA"
    if len(getattr(module, "lora_embedding_A", None) or ()):
        return "embedding LoRA"
    factors = [m for n in ("lora_A", "lora_B") for m in adapter_dicts(module).get(n, {}).values()]
    if not all(type(m) is nn.Linear for m in factors):
        return "non-linear LoRA factor"
    variants = getattr(module, "lora_variant", None)
    if variants:
        return f"LoRA variant {sorted(variants)[0]!r}"
    return None


def style_refusal(name: str, style: str) -> str | None:
    """The one line refusing LoRA adapters on module ``name`` under ``style``, or None when
    the style carries them."""
    if style in CARRYING_STYLES:
        return None
    return (
        f"module {name!r} carries LoRA adapters, but its tensor-parallel style {style!r} "
        f"cannot split them (adapters are split on {', '.join(CARRYING_STYLES)} linears): "
        f"leave {name.rsplit('.', 1)[-1]!r} out of the LoRA targets, or use tp 1"
    )


def check_carriable(name: str, module: nn.Module, style: str) -> None:
    """Raise ``ValueError`` in one line naming the layer when the LoRA layer ``module`` cannot
    keep its adapters under ``style``."""
    refusal = style_refusal(name, style)
    if refusal is not None:
        raise ValueError(refusal)
    leaf = name.rsplit(".", 1)[-1]
    variant = _variant(module)
    if variant is not None:
        raise ValueError(
            f"module {name!r} carries a {variant} adapter, which is not split over tp (plain "
            f"LoRA is): use plain LoRA on {leaf!r}, or tp 1"
        )


def split_off_adapters(
    modules: Mapping[str, nn.Module], styles: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """A plan's resolved ``styles`` with every LoRA layer's style moved to its base layer, and
    the LoRA layers with their styles (their adapters are split after their bases). Raises
    ``ValueError`` naming a LoRA layer whose style cannot carry adapters."""
    out: dict[str, str] = {}
    carried: dict[str, str] = {}
    for name, style in styles.items():
        module = modules[name]
        if not is_lora_layer(module):
            out[name] = style
            continue
        check_carriable(name, module, style)
        out[f"{name}.base_layer"] = style
        carried[name] = style
    return out, carried

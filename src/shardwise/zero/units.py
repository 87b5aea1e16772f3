"""Which parameters go into which flat buffer.

- Stages 0-2 (parameters replicated): buckets of about ``bucket_bytes``, filled in reverse
  registration order, which approximates the order gradients become ready in backward.
- Stage 3 (parameters sharded): one unit per wrapped module. By default each direct child of the
  root that holds parameters, looking inside nn.ModuleList / nn.Sequential containers; or every
  module whose class name is in the wrap policy. Parameters nobody else claims form the root
  unit. A parameter shared by several modules (a tied embedding and output head) belongs to the
  first unit that reaches it; other units that use it record that they need its owner.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from torch import nn

Named = list[tuple[str, nn.Parameter]]


@dataclass
class UnitSpec:
    """A module that gathers parameters around its forward and backward."""

    name: str
    module: nn.Module
    own: Named = field(default_factory=list)  # parameters this unit owns
    foreign: list[str] = field(default_factory=list)  # names of other units it needs


def _split_trainable(named: Named) -> tuple[Named, Named]:
    return [x for x in named if x[1].requires_grad], [x for x in named if not x[1].requires_grad]


def fill_buckets(named: Named, bucket_bytes: int) -> list[Named]:
    """``named`` cut, in order, into runs of at most ``bucket_bytes`` (a larger tensor alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket bytes must be >= 1, got {bucket_bytes}")
    out: list[Named] = []
    current: Named = []
    size = 0
    for name, p in named:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        out.append(current)
    return out


def split_by(named: Named, key: Callable[[nn.Parameter], Hashable] | None) -> list[Named]:
    """``named`` split by ``key`` of each parameter (its data-parallel group), parts in order
    of first appearance, each keeping the order of ``named``; no key: one part."""
    if key is None:
        return [named] if named else []
    parts: dict[Hashable, Named] = {}
    for name, p in named:
        parts.setdefault(key(p), []).append((name, p))
    return list(parts.values())


def buckets(
    model: nn.Module, bucket_bytes: int, key: Callable[[nn.Parameter], Hashable] | None = None
) -> list[tuple[Named, bool]]:
    """Parameter buckets for stages 0-2, in expected gradient-ready order (reverse registration
    order), with a trainable flag. Frozen parameters are not bucketed: they are neither reduced
    nor updated. ``key`` (a parameter's data-parallel group): a bucket holds parameters of one
    key only; the buckets of all keys are ordered by their first parameter, so reductions over
    every group still start as gradients become ready."""
    named = list(model.named_parameters())  # shared parameters appear once
    trainable, _ = _split_trainable(named)
    ordered = trainable[::-1]
    found = [b for part in split_by(ordered, key) for b in fill_buckets(part, bucket_bytes)]
    position = {id(p): i for i, (_, p) in enumerate(ordered)}
    found.sort(key=lambda b: position[id(b[0][1])])  # stable: one key keeps fill order
    return [(b, True) for b in found]


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _default_unit_modules(root: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    found = []
    for name, child in root.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            found += _default_unit_modules(child, f"{full}.")
        elif _has_params(child):
            found.append((full, child))
    return found


def _policy_unit_modules(root: nn.Module, classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    present = {type(m).__name__ for m in root.modules()}
    missing = [c for c in classes if c not in present]
    if missing:
        raise ValueError(
            f"wrap policy names module classes {missing} that the model does not "
            f"contain; it contains: {sorted(present)}"
        )
    found: list[tuple[str, nn.Module]] = []

    def walk(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            full = f"{prefix}{name}"
            if type(child).__name__ in classes:
                found.append((full, child))  # outermost match wins; no nested units
            else:
                walk(child, f"{full}.")

    walk(root, "")
    return found


def units(model: nn.Module, wrap_classes: tuple[str, ...] | None) -> list[UnitSpec]:
    """Stage-3 units in registration order; the root unit (if any) last."""
    modules = (
        _policy_unit_modules(model, wrap_classes) if wrap_classes else _default_unit_modules(model)
    )
    owner: dict[int, str] = {}
    specs: list[UnitSpec] = []
    for uname, module in modules:
        spec = UnitSpec(uname, module)
        for pname, p in module.named_parameters():
            if id(p) in owner:
                if owner[id(p)] != uname and owner[id(p)] not in spec.foreign:
                    spec.foreign.append(owner[id(p)])
                continue
            owner[id(p)] = uname
            spec.own.append((f"{uname}.{pname}", p))
        specs.append(spec)
    root = UnitSpec("<root>", model)
    for pname, p in model.named_parameters():
        if id(p) not in owner:
            owner[id(p)] = root.name
            root.own.append((pname, p))
    if root.own:
        specs.append(root)
    return specs


def split_trainable(named: Named) -> tuple[Named, Named]:
    """(trainable, frozen) parameters of a unit: each becomes its own flat buffer, so frozen
    parameters are gathered with the unit but never reduced."""
    return _split_trainable(named)

"""LoRA adapters through ``peft``: the ``--lora`` option's grammar, and the model with only
the adapters trainable (the base frozen, so ZeRO neither reduces nor updates it, at any
stage), and the adapters' initial values, drawn per adapter from its name and the seed (so a
model built on the meta device and one built eagerly start alike, whatever order the modules
are made in)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.parallel.placement import Placement


@dataclass(frozen=True)
class LoraSpec:
    """``--lora r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj,o_proj``."""

    r: int = 16
    """Rank of each adapter."""
    alpha: float = 32.0
    """Scale numerator: the update is ``B @ A * alpha / r``."""
    dropout: float = 0.05
    """Dropout on the adapter's input while training."""
    targets: tuple[str, ...] = field(default=("q_proj", "k_proj", "v_proj", "o_proj"))
    """Module name suffixes that get an adapter."""

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """Parse ``key=value`` pairs; ``targets=`` takes the rest of the list."""
        values: dict[str, Any] = {}
        parts = [p.strip() for p in text.split(",") if p.strip()]
        for i, part in enumerate(parts):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(
                    f"--lora entry {part!r} is not key=value (r, alpha, dropout, targets)"
                )
            if key == "targets":
                values["targets"] = (value, *[p for p in parts[i + 1 :] if "=" not in p])
                rest = [p for p in parts[i + 1 :] if "=" in p]
                if rest:
                    raise ValueError(f"--lora: put targets= last, after {rest[0]!r}")
                break
            if key not in ("r", "alpha", "dropout"):
                raise ValueError(f"--lora key {key!r} is unknown: use r, alpha, dropout, targets")
            try:
                values[key] = int(value) if key == "r" else float(value)
            except ValueError:
                raise ValueError(f"--lora {key}={value!r} is not a number") from None
        spec = cls(**values)
        if spec.r < 1 or spec.alpha <= 0 or not 0 <= spec.dropout < 1 or not all(spec.targets):
            raise ValueError(
                f"--lora needs r >= 1, alpha > 0, 0 <= dropout < 1 and named targets, got {text!r}"
            )
        return spec

    def to_text(self) -> str:
        """The option's text form (``parse`` inverts it)."""
        return (
            f"r={self.r},alpha={self.alpha},dropout={self.dropout},targets={','.join(self.targets)}"
        )


def check_targets(model: nn.Module, spec: LoraSpec) -> None:
    """Raise ``ValueError`` naming each target that matches no linear-like module of
    ``model`` (peft would otherwise fail deep inside, or adapt nothing)."""
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in spec.targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if not list(m.children())}
        )
        raise ValueError(
            f"--lora targets {', '.join(missing)} match no module of the model: choose from "
            f"{', '.join(leaves)}"
        )


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """``peft.get_peft_model`` with ``spec``: adapters on the target modules, every other
    parameter frozen. B starts at zero (peft's default), so the model starts as the base."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, spec)
    alpha: Any = spec.alpha  # peft types it int; a float scale works the same
    config = LoraConfig(
        r=spec.r,
        lora_alpha=alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.targets),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def _adapter_parts(model: nn.Module) -> dict[int, tuple[str, bool]]:
    """id(module) -> (name, is A) for every LoRA ``lora_A`` / ``lora_B`` linear of ``model``."""
    out: dict[int, tuple[str, bool]] = {}
    for name, m in model.named_modules():
        for part, is_a in ((".lora_A.", True), (".lora_B.", False)):
            if part in name and isinstance(m, nn.Linear):
                out[id(m)] = (name, is_a)
    return out


def init_adapter(
    weight: torch.Tensor, name: str, is_a: bool, seed: int, placement: Placement | None = None
) -> None:
    """peft's default init for one adapter weight: A Kaiming-uniform (a = sqrt 5, drawn from a
    generator seeded by ``seed`` and the module's name), B zero: the model starts as the base.
    With a ``placement`` that splits it, ``weight`` is this rank's piece: the whole is drawn
    and the piece kept, so every layout starts alike."""
    with torch.no_grad():
        if not is_a:
            weight.zero_()
            return
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if placement is None or not placement.shards:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
            return
        full = torch.empty(placement.full_shape, dtype=weight.dtype)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        weight.copy_(placement.shard_of(full))


def init_adapters(model: nn.Module, seed: int) -> None:
    """Give every adapter of an eagerly built ``model`` its initial value (``init_adapter``)."""
    parts = _adapter_parts(model)
    for m in model.modules():
        found = parts.get(id(m))
        if found is not None:
            assert isinstance(m, nn.Linear)
            init_adapter(m.weight, *found, seed)


def adapter_init_fn(
    model: nn.Module, seed: int, placements: Mapping[str, Placement] | None = None
) -> Callable[[nn.Module], None]:
    """An ``init_fn`` for ``shardwise.initialize`` of a LoRA model built on the meta device:
    adapters as ``init_adapter`` (``placements``: the parallelized model's, by parameter name,
    for adapters split over tp), every other module by the base model's ``_init_weights``
    (its buffers; its weights come from the model directory)."""
    parts = _adapter_parts(model)
    base_init = getattr(model, "_init_weights", None)
    where = placements or {}

    def init(module: nn.Module) -> None:
        found = parts.get(id(module))
        if found is not None:
            assert isinstance(module, nn.Linear)
            init_adapter(module.weight, *found, seed, where.get(f"{found[0]}.weight"))
        elif callable(base_init):
            base_init(module)

    return init

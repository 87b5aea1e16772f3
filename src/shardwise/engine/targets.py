"""Where each of an engine's parameters keeps its values on this rank, for writing them piece by
piece: a slot of a flat buffer (only the part this rank keeps: at ZeRO-3 its shard range) or the
parameter's own tensor (outside flat buffers). Values are the parameter's local tensor (under
tp its slice, padding included), flattened row-major."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.engine.placements import EnginePlacements
from shardwise.parallel.placement import Placement
from shardwise.zero.flat_param import FlatParam
from shardwise.zero.partition import ParamSlot


@dataclass(frozen=True)
class Target:
    """One parameter: its first name, the object, its placement and where it is stored."""

    name: str
    param: nn.Parameter
    placement: Placement
    flat: FlatParam | None
    slot: ParamSlot | None

    def kept_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the flattened local tensor this rank keeps."""
        if self.flat is None or self.slot is None:
            return 0, self.param.numel()
        return self.flat.kept_range(self.slot)

    def write(self, start: int, flat: torch.Tensor) -> None:
        """Elements ``[start, start + len(flat))`` of the flattened local tensor."""
        if self.flat is not None and self.slot is not None:
            self.flat.write_range(self.slot, start, flat)
            return
        with torch.no_grad():
            self.param.data.view(-1)[start : start + flat.numel()].copy_(flat)


class ParamTargets:
    """Every parameter of ``module`` (tied ones once) with where its kept values go; records
    which were filled."""

    def __init__(
        self,
        module: nn.Module,
        where: dict[int, tuple[FlatParam, ParamSlot]],
        placements: EnginePlacements,
    ) -> None:
        self.by_id: dict[int, Target] = {}
        for name, p in module.named_parameters():
            flat, slot = where.get(id(p), (None, None))
            self.by_id[id(p)] = Target(name, p, placements.of(p), flat, slot)
        self.filled: set[int] = set()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.by_id.values())

    def write_whole(self, param: torch.Tensor, local: torch.Tensor) -> None:
        """Keep this rank's part of ``param``'s whole local tensor ``local``."""
        target = self.by_id[id(param)]
        start, stop = target.kept_range()
        if stop > start:
            target.write(start, local.reshape(-1)[start:stop])
        self.filled.add(id(param))

    def unfilled(self) -> list[str]:
        """Names of the parameters nothing wrote."""
        return [t.name for i, t in self.by_id.items() if i not in self.filled]

    def largest_bytes(self, dtype: torch.dtype) -> int:
        """The largest local parameter's size at ``dtype``."""
        size = torch.empty((), dtype=dtype).element_size()
        return max((t.param.numel() * size for t in self), default=0)

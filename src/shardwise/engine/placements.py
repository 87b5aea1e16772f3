"""The engine's view of where each parameter lives, derived from the plan's placements.

``shardwise.parallelize`` (or ``shardwise.parallel.tensor.parallelize``) returns one
``Placement`` per parameter name; the engine completes it for the parameters the plan does not
name (replicated along every axis) and for the pipeline axis (a ``PipelineEngine`` adds each
parameter's stage), checks it against the tensors, and derives from it what it needs: the
gradient-norm reduction, the checkpoint boxes (who writes which piece) and the full state
dicts. ZeRO's flat sharding over the data-parallel group sits on top and is not a placement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from shardwise.comm.groups import Group
from shardwise.mesh import Axis, Mesh
from shardwise.parallel.placement import (
    ZERO_AXES,
    NormReduction,
    Placement,
    Style,
    replicated,
)
from shardwise.zero.param_layout import ParamLayout

ExtraStyles = Callable[[str, nn.Parameter], Mapping[str | Axis, Style]]
_SPLIT_LAYERS = (
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelConv1D",
    "RowParallelConv1D",
    "VocabParallelEmbedding",
)


class EnginePlacements:
    """Every parameter of ``model`` (by object) with its placement on ``mesh``.

    Args:
        model: the engine's model (tp-split and pipeline-split already).
        mesh: the engine's mesh, or None (a plain data-parallel group: everything replicated).
        given: the plan's placements by parameter name (None: the model was not split).
        extra: styles to add per parameter (the pipeline axis).
        zero: the group ZeRO shards a parameter replicated along every data-parallel axis over
            (the engine's dp group; with no mesh, every parameter's).

    Raises:
        ValueError: naming the parameter whose tensor does not have its placement's local
            shape, or a tensor-parallel layer whose placements were not given.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh | None,
        given: Mapping[str, Placement] | None,
        extra: ExtraStyles | None = None,
        zero: Group | None = None,
    ) -> None:
        self.mesh = mesh
        self._zero = zero
        if given is None:
            _refuse_unplanned_split(model)
        self._by_id: dict[int, Placement] = {}
        for name, p in model.named_parameters():
            where = (given or {}).get(name)
            styles: dict[str | Axis, Style] = dict(extra(name, p)) if extra else {}
            if mesh is None:
                where = where or replicated(name, p.shape)
            elif where is None or styles:
                base: dict[str | Axis, Style] = {}
                if where is not None:
                    base = {a.axis: a.style for a in where.axes}
                full = where.full_shape if where is not None else tuple(p.shape)
                where = Placement.on(mesh, name, full, {**base, **styles})
            if tuple(p.shape) != where.local_shape():
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(p.shape)} on this rank but its "
                    f"placement ({where.axes}) gives {where.local_shape()}: pass the placements "
                    "returned by the parallelize call that split it"
                )
            self._by_id[id(p)] = where

    def of(self, param: torch.Tensor) -> Placement:
        """``param``'s placement; ValueError for a tensor that is not a parameter of the
        model."""
        got = self._by_id.get(id(param))
        if got is None:
            raise ValueError("not a parameter of this engine's model")
        return got

    def get(self, param: torch.Tensor) -> Placement | None:
        return self._by_id.get(id(param))

    def group(self, axis: Axis) -> Group:
        assert self.mesh is not None, "a placement without a mesh names no axis"
        return self.mesh.group(axis)

    def zero_group(self, param: torch.Tensor) -> Group:
        """The data-parallel group ZeRO shards ``param``'s flat buffer over: the ranks of the
        ``ZERO_AXES`` it is replicated along (the engine's dp group for a parameter replicated
        along all of them, today every one a plan makes; a parameter split along one, an
        expert split over its axis, is sharded over the others only).

        Raises:
            ValueError: naming the parameter when it is split along every data-parallel axis.
        """
        assert self._zero is not None, "the engine gives its dp group"
        axes = self.of(param).zero_axes
        if self.mesh is None or axes == ZERO_AXES:
            return self._zero
        if not axes:
            raise ValueError(
                f"parameter {self.of(param).name!r} is split along every data-parallel axis "
                f"{[str(a) for a in ZERO_AXES]}: replicate it along one for ZeRO to shard it"
            )
        return self.mesh.group(*axes).with_debug(self._zero.debug)

    def norm_reduction(self, model: nn.Module) -> NormReduction:
        """The gradient-norm reduction over every axis that splits a trainable parameter."""
        trainable = [(p, self.of(p)) for p in model.parameters() if p.requires_grad]
        return NormReduction(trainable, self.group)

    def layouts(
        self, model: nn.Module, zero_group: Callable[[torch.Tensor], Group]
    ) -> dict[int, ParamLayout]:
        """Each split or mesh-replicated parameter's saved box by id: pieces of split
        parameters at their offsets (padding cut); a piece that the ranks of an axis hold
        identical copies of (other than ZeRO's, whose flat ranges say who writes) is written
        by the first of them only. ``zero_group``: the group whose flat ranges hold a
        parameter."""
        out: dict[int, ParamLayout] = {}
        for p in model.parameters():
            where = self.of(p)
            copies = [self.group(a) for a in where.copies]
            # copies inside the parameter's ZeRO group: its flat ranges say who writes
            inside = set(zero_group(p).ranks)
            copies = [g for g in copies if not set(g.ranks) <= inside]
            if where.shards or copies or not where.first_holder:
                writes = all(g.rank == 0 for g in copies) and where.first_holder
                out[id(p)] = ParamLayout(
                    tuple(p.shape), tuple(where.real_pieces()), where.full_shape, writes=writes
                )
        return out


def _refuse_unplanned_split(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if type(m).__name__ in _SPLIT_LAYERS and type(m).__module__.startswith("shardwise."):
            raise ValueError(
                f"module {name!r} is a tensor-parallel {type(m).__name__}, but initialize got no "
                "placements: pass what parallelize returned (shardwise.initialize(parallelized, "
                "...), or placements=tp.placements for shardwise.parallel.tensor.parallelize)"
            )

"""``parallelize``: apply a tensor-parallel plan to a model from outside.

Linear (``nn.Linear`` or ``Conv1D``) and embedding modules named by the plan are replaced by
their parallel counterparts holding the same ``nn.Parameter`` objects, whose data becomes this
rank's shard; the model's own forward code runs unchanged. ``sequence`` modules keep running
as they are, on this rank's slice of the sequence when sequence parallelism is on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from shardwise.comm.objects import all_gather_object
from shardwise.mesh import Axis, Mesh
from shardwise.parallel.pipeline.stage import PipelineModule
from shardwise.parallel.placement import Placement, Replicate, Shard
from shardwise.parallel.tensor import mappings, rng, state
from shardwise.parallel.tensor.adapters import adapter_dicts, split_off_adapters
from shardwise.parallel.tensor.conv1d import (
    FUSED_BLOCKS,
    column_layer,
    features,
    localize_heads,
    params_of,
    row_layer,
    split_dims,
    weight_shape,
)
from shardwise.parallel.tensor.entry import SequenceEntries, gather_on_entry
from shardwise.parallel.tensor.layers import Region, VocabParallelEmbedding
from shardwise.parallel.tensor.plan import resolve, unmatched_error
from shardwise.parallel.tensor.validate import validate


class TensorParallel:
    """What ``parallelize`` did to a model: each parameter's placement along tp (a
    ``Placement`` value per parameter name), full state dicts, and this rank's dropout stream
    for tp-sharded regions."""

    def __init__(self, model: nn.Module, mesh: Mesh, sequence_parallel: bool) -> None:
        self.model = model
        self.mesh = mesh
        self.group = mesh.group(Axis.TP)
        self.tp_size, self.tp_rank = mesh.tp_size, mesh.rank(Axis.TP)
        self.sequence_parallel = sequence_parallel
        self.region = Region(self.group, sequence_parallel)
        self.entries: SequenceEntries | None = None  # the plan's sequence_entry modules, under SP
        # this record's own view of the model's parameter objects while it splits them
        self._by_id: dict[int, Placement] = {}

    # ---- placements ---------------------------------------------------------------------
    def placement_of(self, param: torch.Tensor) -> Placement:
        """The placement of one of the model's parameters (replicated if never sharded)."""
        got = self._by_id.get(id(param))
        if got is None:
            raise KeyError("not a parameter of the parallelized model")
        return got

    @property
    def placements(self) -> dict[str, Placement]:
        """``{parameter name: placement}`` for every parameter name of the model (a tied
        parameter under each of its names, its first name inside the value)."""
        return {name: self._by_id[id(p)] for name, p in _named_params(self.model)}

    def _place(self, param: torch.Tensor, placement: Placement, owner: str) -> None:
        seen = self._by_id.get(id(param))
        if seen is not None:
            if (seen.style(Axis.TP), seen.full_shape) != (
                placement.style(Axis.TP),
                placement.full_shape,
            ):
                raise ValueError(
                    f"parameter {seen.name!r} is tied into {owner!r} with another layout: "
                    f"{seen.style(Axis.TP)} of {seen.full_shape} there, "
                    f"{placement.style(Axis.TP)} of {placement.full_shape} here; tied layers "
                    "must split the same way"
                )
            return
        self._by_id[id(param)] = placement
        if placement.shards:
            with torch.no_grad():
                param.data = placement.shard_of(param.data)

    def _shard(
        self, param: torch.Tensor, name: str, full: tuple[int, ...], dim: int, blocks: int = 1
    ) -> None:
        padded = full[dim] if full[dim] % self.tp_size else None
        style = Shard(dim, padded, blocks) if self.tp_size > 1 else Replicate()
        self._place(param, Placement.on(self.mesh, name, full, {Axis.TP: style}), name)

    def _replicate(self, param: torch.Tensor, name: str, partial: bool) -> None:
        style = Replicate(partial and self.tp_size > 1)
        fresh = id(param) not in self._by_id
        self._place(param, Placement.on(self.mesh, name, param.shape, {Axis.TP: style}), name)
        if fresh and partial and self.tp_size > 1 and param.requires_grad:
            # Sum over tp each backward's gradient before it is accumulated: every tp rank
            # then holds the full gradient, whatever accumulates or reduces it next (a plain
            # optimizer, ZeRO over dp, a pipeline stage, gradient accumulation).
            param.register_hook(functools.partial(mappings.all_reduce_grad, group=self.group))

    # ---- training-loop duties -----------------------------------------------------------
    def partial_params(self) -> list[nn.Parameter]:
        """Replicated parameters used on 1/tp of the sequence (under SP): each backward
        all-reduces their gradient over tp before accumulating it (one all_reduce each)."""
        return [p for p in self.model.parameters() if self._by_id[id(p)].partial_axes]

    # ---- full (unsharded) state ---------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded ``state_dict`` under the model's own names, padding removed: what the
        model held before ``parallelize``. Every tp rank gets it.

        Communicates: one all_gather over tp per sharded tensor.
        """
        return state.full_state_dict(self.model, self._by_id, self.mesh.group)

    def gather_state_dict(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full state dict from a tp-local one under the model's names (e.g. copies of
        ``model.state_dict()`` kept during training; ``engine.state_dict()`` is full already):
        every tp-sharded entry all_gathered over tp and unpadded. Call on every tp rank."""
        names = {
            n: self._by_id[id(t)]
            for n, t in self.model.state_dict(keep_vars=True).items()
            if id(t) in self._by_id
        }
        return state.gather_state_dict(local, names, self.mesh.group)

    def load_full_state_dict(self, full: Mapping[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (as ``full_state_dict`` returns): each rank copies in
        its shard. Raises ``ValueError`` naming a missing key or a wrong shape."""
        state.load_full_state_dict(self.model, self._by_id, full)

    @contextmanager
    def sharded_rng(self) -> Iterator[None]:
        """Run the body (e.g. dropout on local heads) on this tp rank's own random stream."""
        with rng.fork(self.tp_rank):
            yield


def _named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters(remove_duplicate=False))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, new)


def _apply_linear(tp: TensorParallel, name: str, m: nn.Module, style: str) -> None:
    """Split an ``nn.Linear`` or a ``Conv1D`` (see ``conv1d``) as ``style`` says."""
    in_dim, out_dim = split_dims(m)
    shape, n_out = weight_shape(m), features(m)[1]
    weight, bias = params_of(m)
    if style == "rowwise":
        tp._shard(weight, f"{name}.weight", shape, in_dim)
        _replace(tp.model, name, row_layer(m, tp.region))
        if bias is not None:
            tp._replicate(bias, f"{name}.bias", partial=tp.sequence_parallel)
        return
    blocks = FUSED_BLOCKS.get(style, 1)
    tp._shard(weight, f"{name}.weight", shape, out_dim, blocks)
    if bias is not None:
        tp._shard(bias, f"{name}.bias", (n_out,), 0, blocks)
    gather = style == "colwise_gather"
    _replace(tp.model, name, column_layer(m, tp.region, n_out, gather))


def _apply_adapters(tp: TensorParallel, name: str, layer: nn.Module, style: str) -> None:
    """Split the adapters of the LoRA layer ``name`` to match its base, already split (see
    ``adapters``): B column-parallel under a column base, A row-parallel under a row base, the
    other factor replicated (its gradient partial over tp under sequence parallelism)."""
    row = style == "rowwise"
    split, whole = ("lora_A", "lora_B") if row else ("lora_B", "lora_A")
    dicts = adapter_dicts(layer)
    for key in list(dicts["lora_A"]):
        factor = dicts[split][key]
        assert isinstance(factor, nn.Linear), "check_carriable admits linear adapters only"
        _apply_linear(tp, f"{name}.{split}.{key}", factor, style)
        for pname, p in dicts[whole][key].named_parameters(f"{name}.{whole}.{key}"):
            tp._replicate(p, pname, partial=tp.sequence_parallel)
        if tp.tp_size == 1:
            continue
        drop = dicts["lora_dropout"][key]
        if isinstance(drop, nn.Dropout) and drop.p > 0 and (row or tp.sequence_parallel):
            _fork_unless_whole(drop, tp, row)
        if not row and tp.sequence_parallel:
            _carry_whole(layer, dicts["lora_A"][key], tp.region)


def _fork_unless_whole(drop: nn.Module, tp: TensorParallel, row: bool) -> None:
    """The dropout before A draws from this rank's stream when its input differs per rank:
    this rank's features (a row base), or under SP this rank's tokens (a column base outside
    a ``whole_sequence`` module); before a whole A on the same input, every rank's mask is
    the same (the replicated stream)."""
    hooks = rng.ForkOnForward(tp.tp_rank)

    def pre(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if row or not tp.region.is_whole(args[0]):
            hooks.pre(module, args)

    drop.register_forward_pre_hook(pre)
    drop.register_forward_hook(hooks.post, always_call=True)


def _carry_whole(layer: nn.Module, lora_a: nn.Module, region: Region) -> None:
    """Under SP, A's output is whole when the layer's input is (inside a ``whole_sequence``
    module): B's entry then takes it as it is, as the base's does with the input."""
    whole = [False]

    def pre(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        whole[0] = region.is_whole(args[0])

    def post(module: nn.Module, args: object, out: torch.Tensor) -> None:
        if whole[0]:
            region.mark_whole(out)

    layer.register_forward_pre_hook(pre)
    lora_a.register_forward_hook(post)


def _apply_embedding(tp: TensorParallel, name: str, m: nn.Embedding) -> None:
    tp._shard(m.weight, f"{name}.weight", (m.num_embeddings, m.embedding_dim), 0)
    whole = tp.entries is not None  # the region starts later, at the plan's entry
    _replace(tp.model, name, VocabParallelEmbedding(m, tp.region, m.num_embeddings, whole))


def _apply_sequence(tp: TensorParallel, name: str, m: nn.Module) -> None:
    for pname, p in m.named_parameters(prefix=name):
        if id(p) not in tp._by_id:
            tp._replicate(p, pname, partial=tp.sequence_parallel)
    if not tp.sequence_parallel or tp.tp_size == 1:
        return
    entries = tp.entries
    if entries is not None:
        m.register_forward_pre_hook(lambda mod, args: entries.check_inside(name))
    if isinstance(m, nn.Embedding):  # e.g. positions: keep this rank's slice of the sequence
        group = tp.group
        m.register_forward_hook(
            lambda mod, args, out: mappings.slice_sequence(out, args[0].dim() - 1, group)
        )
        return
    hooks = rng.ForkOnForward(tp.tp_rank)
    m.register_forward_pre_hook(hooks.pre)
    m.register_forward_hook(hooks.post, always_call=True)


def _replicate_rest(tp: TensorParallel) -> None:
    for name, p in tp.model.named_parameters():
        if id(p) not in tp._by_id:
            tp._replicate(p, name, partial=False)


def _resolve(model: nn.Module, mesh: Mesh, plan: Mapping[str, str]) -> dict[str, str]:
    """The plan's styles for ``model``; on a ``PipelineModule`` a pattern must match on some
    stage (agreed over pp), not on each."""
    if not isinstance(model, PipelineModule):
        return resolve(model, plan)
    unmatched: list[str] = []
    styles = resolve(model, plan, unmatched)
    refuse_unmatched_on_every_stage(model, mesh, plan, unmatched)
    return styles


def _checked_styles(
    model: nn.Module, resolved: dict[str, str], tp_size: int, sp: bool
) -> tuple[dict[str, str], dict[str, str]]:
    """The plan's ``resolved`` styles with LoRA layers' moved to their bases, and those LoRA
    layers (``split_off_adapters``), after checking the whole plan at ``tp_size``."""
    styles, carried = split_off_adapters(dict(model.named_modules()), resolved)
    validate(model, styles, tp_size, sp, carried)
    return styles, carried


def check_plan(model: nn.Module, plan: Mapping[str, str], tp_size: int) -> None:
    """Raise what ``parallelize`` would for ``plan`` at ``tp_size`` (no sequence parallelism),
    changing nothing: a meta ``model`` is fine, no mesh or group is needed."""
    _checked_styles(model, resolve(model, plan), tp_size, False)


def refuse_unmatched_on_every_stage(
    model: nn.Module, mesh: Mesh, plan: Mapping[str, str], unmatched: list[str]
) -> None:
    """Raise for a pattern of ``plan`` that matches no module on any pp stage (``unmatched``:
    this stage's), the same on every pp rank. Communicates: one all_gather_object over pp."""
    per_stage = all_gather_object(unmatched, group=mesh.group(Axis.PP))
    for pattern in plan:
        if all(pattern in stage for stage in per_stage):
            raise unmatched_error(pattern, plan[pattern], model)


def parallelize(
    model: nn.Module, mesh: Mesh, plan: Mapping[str, str], sequence_parallel: bool = False
) -> TensorParallel:
    """Split ``model`` over ``mesh``'s tp axis as ``plan`` says, in place.

    Args:
        model: any module; the plan names its submodules (glob patterns, see ``plan.STYLES``).
        mesh: the device mesh; its ``tp`` axis is used.
        plan: ``{module-name pattern: style}``.
        sequence_parallel: run ``sequence`` modules on 1/tp of the sequence (dim 1 of
            ``[batch, seq, hidden]`` activations); the sequence length must divide by tp.

    A peft LoRA layer named by a linear style is split with its adapters (see
    ``shardwise.parallel.tensor.adapters``): its base as the style says, B column-split under a
    column-parallel base, A row-split under a row-parallel base, the other factor replicated.

    A ``PipelineModule`` is split stage by stage under its own names (``layers.{i}.*`` by
    global layer index, ``tied.{key}.*``): each pp rank applies the plan to the layers it
    holds, and a pattern need only match on some stage.

    Returns the ``TensorParallel`` record (placements, full state dicts). Under sequence
    parallelism the replicated parameters of ``sequence`` modules and the row-parallel biases
    see 1/tp of the tokens: a gradient hook all-reduces each one's gradient over tp in every
    backward, so nothing is owed at step time.
    Raises ``ValueError``/``TypeError`` naming the module for a pattern matching nothing, a
    dimension that does not divide by tp (other than a vocabulary), a module whose type does
    not fit its style, or LoRA adapters on a layer whose style cannot split them.
    Communicates nothing (a ``PipelineModule``: one all_gather_object over pp of the patterns
    matching nothing on each stage: two all_gathers).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a shardwise Mesh, got {type(mesh).__name__}")
    modules = dict(model.named_modules())
    styles, carried = _checked_styles(model, _resolve(model, mesh, plan), mesh.tp_size,
                                      bool(sequence_parallel))  # fmt: skip
    tp = TensorParallel(model, mesh, bool(sequence_parallel))
    entry_names = [n for n, s in styles.items() if s == "sequence_entry"]
    if entry_names and tp.sequence_parallel and tp.tp_size > 1:
        tp.entries = SequenceEntries(model, tp.group, entry_names)
    order = sorted(styles, key=lambda n: styles[n] != "vocab_embedding")  # embeddings first
    for name in order:
        style, module = styles[name], modules[name]
        if style == "sequence_entry":
            continue  # wired above (nothing to do without sequence parallelism)
        if style == "whole_sequence":
            if tp.sequence_parallel and tp.tp_size > 1:
                gather_on_entry(module, name, tp.region)
            continue
        if style == "local_heads":
            localize_heads(module, tp.tp_size)
            continue
        if style == "vocab_embedding":
            _apply_embedding(tp, name, module)
        elif style == "sequence":
            _apply_sequence(tp, name, module)
        else:
            _apply_linear(tp, name, module, style)
    for name, style in carried.items():
        _apply_adapters(tp, name, modules[name], style)
    _replicate_rest(tp)
    return tp

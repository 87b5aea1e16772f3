"""The built-in GPT's parallel recipe: tensor, sequence and pipeline parallelism in one plan.

``plan(cfg, mesh)`` is what ``shardwise train`` applies and what a user's script applies::

    parallelized = shardwise.parallelize(GPT(cfg), mesh, plans.gpt.plan(cfg, mesh))

Without a pipeline the tensor-parallel plan names the GPT's own modules (``tp_plan``); with one
the GPT is first split into pipeline layers (``pipeline_layers``: token embedding, positions,
blocks, final norm, and the output head tied to the token embedding) and the plan names them by
the pipeline's names (``pipeline_tp_plan``). Either way the loss runs on vocab-sharded logits
(``vocab_parallel_cross_entropy``) under tensor parallelism, so full logits never exist.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.mesh import Axis, Mesh
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.context.attention import context_mean
from shardwise.parallel.parallelize import ContextPlan, ParallelPlan, PipelineSplit
from shardwise.parallel.pipeline import LayerFn, Tied
from shardwise.parallel.pipeline.stage import Entry
from shardwise.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def tp_plan() -> dict[str, str]:
    """Tensor-parallel plan for ``GPT`` (see ``shardwise.parallel.tensor.parallelize``).

    Attention is split by heads and the MLP by its hidden width (Megatron-LM); the token
    embedding and the tied output head by the vocabulary, so the loss runs on vocab-sharded
    logits (``vocab_parallel_cross_entropy``) and full logits never exist. The norms, the
    position embedding and dropout are ``sequence`` modules: under sequence parallelism they run
    on 1/tp of the sequence. ``n_head`` must divide by tp.
    """
    return {
        "tok_emb": "vocab_embedding",
        "pos_emb": "sequence",
        "drop": "sequence",
        "blocks.*.ln_{attn,mlp}": "sequence",
        "blocks.*.drop": "sequence",
        "blocks.*.attn.{q,k,v}_proj": "colwise",
        "blocks.*.attn.out_proj": "rowwise",
        "blocks.*.mlp.fc_in": "colwise",
        "blocks.*.mlp.fc_out": "rowwise",
        "ln_f": "sequence",
        "head": "colwise",
    }


def pipeline_tp_plan(cfg: GPTConfig) -> dict[str, str]:
    """``tp_plan()`` under the names of a ``PipelineModule`` over ``pipeline_layers``:
    ``tied.tok_emb``, ``layers.1`` (positions), ``layers.{2..n_layer+1}`` (blocks),
    ``layers.{n_layer+2}`` (the final norm). The tied head then returns vocab-sharded logits
    (the embedding projects onto its own rows); ``loss`` takes them."""
    return {
        "tied.tok_emb": "vocab_embedding",
        "layers.1.pos_emb": "sequence",
        "layers.*.drop": "sequence",
        "layers.*.ln_{attn,mlp}": "sequence",
        "layers.*.attn.{q,k,v}_proj": "colwise",
        "layers.*.attn.out_proj": "rowwise",
        "layers.*.mlp.fc_in": "colwise",
        "layers.*.mlp.fc_out": "rowwise",
        f"layers.{cfg.n_layer + 2}": "sequence",
    }


def pipeline_layers(model: GPT, sequence_parallel_size: int = 1) -> list[Entry]:
    """``model`` as a flat list of pipeline layers for ``PipelineModule``: the token
    embedding, positions (+ dropout), the blocks, the final norm and the head. The head and the
    token embedding are one ``Tied("tok_emb")`` entry, so the first and last stage keep
    bitwise-equal copies. The stages output logits (``loss`` takes them).

    ``sequence_parallel_size``: the tp degree when sequence parallelism is on: the positions
    layer then gets 1/tp of the sequence and takes the whole sequence's positions, of which its
    ``sequence`` position embedding keeps this rank's slice."""
    scale = sequence_parallel_size

    def add_positions(layer: Any, x: torch.Tensor) -> torch.Tensor:  # x: [batch, seq / sp, d]
        pos = torch.arange(x.shape[1] * scale, device=x.device)
        pos_emb = layer.pos_emb(pos)  # [seq / sp, d_model]
        if pos_emb.shape[0] != x.shape[1]:
            raise ValueError(
                f"the positions layer got {x.shape[1]} positions but its embedding returned "
                f"{pos_emb.shape[0]}: pass sequence_parallel_size=tp to pipeline_layers when "
                "the plan runs sequence parallelism"
            )
        return layer.drop(x + pos_emb)

    def head(emb: nn.Module, h: torch.Tensor) -> torch.Tensor:
        # a vocab-parallel embedding projects onto its own rows
        project = getattr(emb, "project", None)
        if project is not None:
            return project(h)  # [batch, seq, vocab_size / tp]
        weight = emb.weight
        assert isinstance(weight, torch.Tensor)
        return F.linear(h, weight)  # [batch, seq, vocab_size]

    return [
        Tied("tok_emb", model.tok_emb),
        LayerFn(add_positions, pos_emb=model.pos_emb, drop=model.drop),
        *model.blocks,
        model.ln_f,
        Tied("tok_emb", model.tok_emb, forward_fn=head),
    ]


def context_plan(pipeline: bool = False, method: str = "ring") -> ContextPlan:
    """Context parallelism for ``GPT``: each block's attention is exact over the cp axis (its
    ``scaled_dot_product_attention`` call), and the position embedding takes global positions.
    ``pipeline``: under the names of ``pipeline_layers``."""
    if pipeline:
        return ContextPlan({"layers.*.attn": "sdpa", "layers.1.pos_emb": "positions"}, method)
    return ContextPlan({"blocks.*.attn": "sdpa", "pos_emb": "positions"}, method)


def loss(cfg: GPTConfig, mesh: Mesh | None = None) -> Loss:
    """The loss on the GPT's logits (the last pipeline stage's, or the model's output): cross
    entropy, vocab-parallel over the mesh's tp axis when it has one, averaged over every token
    of every cp rank when the mesh has cp (``context_mean``); ``-100`` targets count nothing."""
    cp = mesh.group(Axis.CP) if mesh is not None and mesh.cp_size > 1 else None
    tp = mesh.group(Axis.TP) if mesh is not None and mesh.tp_size > 1 else None

    def total(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        if tp is not None:
            return vocab_parallel_cross_entropy(
                logits, targets, tp, vocab_size=cfg.vocab_size, reduction=reduction
            )
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)

    if cp is None:
        return lambda logits, targets: total(logits, targets, "mean")
    group = cp
    return lambda logits, targets: context_mean(
        total(logits, targets, "sum"), (targets != -100).sum(), group
    )


def plan(
    cfg: GPTConfig,
    mesh: Mesh,
    *,
    sequence_parallel: bool = False,
    virtual_stages: int = 1,
    recompute: Sequence[str] = (),
    cp_method: str = "ring",
) -> ParallelPlan:
    """The GPT's plan on ``mesh``: split into ``mesh.pp_size`` x ``virtual_stages`` pipeline
    stages balanced by parameters (when pp > 1), tensor parallel over tp (sequence parallel
    with ``sequence_parallel``), context parallel over cp (``cp_method``: ``"ring"`` or
    ``"all_to_all"``), then ``recompute`` (module class names, e.g. ``["Block"]``)."""
    context = context_plan(mesh.pp_size > 1, cp_method) if mesh.cp_size > 1 else None
    if mesh.pp_size == 1:
        return ParallelPlan(
            tensor=tp_plan(),
            sequence_parallel=sequence_parallel,
            recompute=tuple(recompute),
            context=context,
        )
    sp = mesh.tp_size if sequence_parallel else 1

    def layers(model: nn.Module) -> list[Entry]:
        if not isinstance(model, GPT):
            raise TypeError(f"the GPT plan splits a shardwise GPT, got {type(model).__name__}")
        return pipeline_layers(model, sp)

    split = PipelineSplit(layers, loss(cfg, mesh), "parameters", virtual_stages)
    return ParallelPlan(
        tensor=pipeline_tp_plan(cfg),
        sequence_parallel=sequence_parallel,
        pipeline=split,
        recompute=tuple(recompute),
        context=context,
    )

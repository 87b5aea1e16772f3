"""The tensor-parallel plan for Hugging Face Llama (and models that copy its naming)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardwise.mesh import Axis, Mesh
from shardwise.parallel.context.attention import context_mean
from shardwise.parallel.parallelize import ContextPlan


def tp_plan() -> dict[str, str]:
    """Plan for Hugging Face ``LlamaForCausalLM`` naming (and models that copy it).

    Attention is split by heads (q, k, v column-parallel; o row-parallel), the MLP by its
    intermediate width (gate, up column-parallel; down row-parallel), the token embedding by the
    vocabulary; ``lm_head`` is column-parallel with its output gathered, because the model's own
    loss needs full logits. ``num_attention_heads`` and ``num_key_value_heads`` must divide by
    tp. Under sequence parallelism the norms run on 1/tp of the sequence; the region starts at
    the first decoder layer (``sequence_entry``), because the model derives positions and the
    causal mask from the embedding output's length, which therefore stays whole; attention
    reshapes by its input's length, so it receives the whole sequence (``whole_sequence``).
    """
    return {
        "model.embed_tokens": "vocab_embedding",
        "model.layers.0": "sequence_entry",
        "model.layers.*.{input,post_attention}_layernorm": "sequence",
        "model.norm": "sequence",
        "model.layers.*.self_attn": "whole_sequence",
        "model.layers.*.self_attn.{q,k,v}_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.{gate,up}_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather",
    }


def context_plan(method: str = "ring") -> ContextPlan:
    """Context parallelism for Hugging Face Llama naming: every decoder layer's attention runs
    exact over the cp axis through shardwise's registered attention implementation (grouped
    key/value heads travel unrepeated), and the rotary embedding takes global positions.

    Under cp the model's own shifted loss (``labels=``) would pair tokens across chunk ends:
    give targets already shifted (the next token at each position) to ``loss``."""
    return ContextPlan(
        {"model.layers.*.self_attn": "hf_attention", "model.rotary_emb": "positions"}, method
    )


def loss(mesh: Mesh) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross entropy of full-vocabulary logits [batch, seq, vocab] against already-shifted
    targets [batch, seq] (``-100``: not counted), averaged over every token of every cp rank."""
    group = mesh.group(Axis.CP) if mesh.cp_size > 1 else None

    def fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if group is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return context_mean(total, (targets != -100).sum(), group)

    return fn

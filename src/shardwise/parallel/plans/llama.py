"""The tensor-parallel plan for Hugging Face Llama (and models that copy its naming)."""

from __future__ import annotations


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

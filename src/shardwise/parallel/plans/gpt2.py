"""The tensor-parallel plan for Hugging Face GPT-2 (``GPT2LMHeadModel`` naming)."""

from __future__ import annotations


def tp_plan() -> dict[str, str]:
    """Plan for Hugging Face ``GPT2LMHeadModel`` naming.

    GPT-2's linear layers are ``Conv1D`` (weight stored ``[in, out]``): the styles split them
    along the right dims. Attention is split by heads: the fused ``c_attn`` projection is
    column-parallel over its three blocks (``colwise_qkv``: a rank holds its heads of q, of k
    and of v), ``c_proj`` row-parallel, and the attention module runs on its local heads
    (``local_heads``: ``n_head`` must divide by tp). The MLP is split by its inner width
    (``c_fc`` column-parallel, ``c_proj`` row-parallel; their biases: split with the columns,
    added once after the sum over tp). The token embedding ``wte`` is split by the vocabulary
    (padded when it does not divide by tp); ``lm_head``, tied to it, is column-parallel with
    its output gathered, because the model's own loss needs full logits. The position
    embedding ``wpe`` and the LayerNorms are replicated. The plan has no sequence styles: under
    sequence parallelism ``parallelize`` refuses, naming a replicated parameter.
    """
    return {
        "transformer.wte": "vocab_embedding",
        "transformer.h.*.attn": "local_heads",
        "transformer.h.*.attn.c_attn": "colwise_qkv",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_gather",
    }

"""Activation bytes per rank: what the forward keeps for the backward.

Two models. ``gpt_saved_activation_bytes`` counts, tensor by tensor, what shardwise's built-in
``GPT`` saves (checked against autograd in the tests). ``layer_activation_bytes`` is Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4, eq. 1-4
and Table 2) for any transformer layer, with s tokens per sequence, b sequences, h hidden,
a heads, t = tp, 16-bit activations and 1-byte dropout masks:

    no parallelism               s·b·h·(34 + 5·a·s/h)
    tensor parallel              s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel   s·b·h·(34 + 5·a·s/h) / t
    + selective recompute        s·b·h·34 / t        (s·b·h·(10 + 24/t) without SP)
    full recompute               2·s·b·h             (÷ t with SP)

A pipeline rank keeps the activations of every micro-batch in flight
(``in_flight_activation_bytes``).
"""

from __future__ import annotations

import math
from fractions import Fraction

from shardwise.costmodel.memory import BYTES_PER_ELEMENT, check_count, check_precision
from shardwise.models.gpt import GPTConfig

RECOMPUTE = ("none", "selective", "full")
"""Recompute modes of ``layer_activation_bytes``: none, attention only, every layer."""
HALF_BYTES = 2  # the element size Korthikanti et al.'s formulas count


def layer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    *,
    element_bytes: int = HALF_BYTES,
) -> int:
    """Bytes of activations one transformer layer keeps per tp rank (Korthikanti et al.),
    scaled from their 16-bit elements to ``element_bytes`` (4: fp32 activations)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE}")
    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch), ("tp", tp)):
        if v < 1:
            raise ValueError(f"{name}={v}: set it to an int >= 1")
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = Fraction(s * b * h)
    split = Fraction(1, t) if sequence_parallel else Fraction(1)
    if recompute == "full":
        per = 2 * sbh * split
    elif recompute == "selective":
        per = 34 * sbh / t if sequence_parallel else sbh * (10 + Fraction(24, t))
    elif sequence_parallel:
        per = sbh * (34 + Fraction(5 * a * s, h)) / t
    else:
        per = sbh * (10 + Fraction(24, t) + Fraction(5 * a * s, h * t))
    return math.ceil(per * Fraction(element_bytes, HALF_BYTES))


def in_flight_activation_bytes(
    per_layer_bytes: int, layers: float, in_flight: Fraction | float
) -> int:
    """Peak activation bytes of a pipeline rank: ``in_flight`` micro-batches (in units of one
    micro-batch through all of the rank's ``layers``) of ``per_layer_bytes`` each."""
    return math.ceil(in_flight * layers * per_layer_bytes)


def _block_bytes(cfg: GPTConfig, tokens: int, micro_batch: int, seq_len: int, act: int) -> int:
    """Bytes one ``Block`` saves for backward."""
    d = cfg.d_model
    # 16 tensors of [tokens, d_model]: block input and ln_attn output, q, k, v, the attention
    # output (out_proj reads a view of it, no copy), the mid-block residual and ln_mlp output,
    # and the 4x MLP hidden before and after GELU.
    stream = 16 * tokens * d * act
    # Each LayerNorm keeps mean and 1/std per token; counted as fp32 (what CUDA keeps).
    norm_stats = 2 * 2 * tokens * 4
    # Flash attention keeps one fp32 logsumexp per head and query.
    logsumexp = micro_batch * cfg.n_head * seq_len * 4
    # Dropout on both residual branches keeps a mask each: one byte per element on CUDA,
    # the activation dtype on CPU; counted at the larger.
    masks = 2 * tokens * d * act if cfg.dropout > 0 else 0
    return stream + norm_stats + logsumexp + masks


def _outside_bytes(cfg: GPTConfig, tokens: int, seq_len: int, act: int) -> int:
    """Bytes saved outside the blocks: embeddings, final norm, head and loss."""
    d = cfg.d_model
    token_ids = tokens * 8 + seq_len * 8  # int64 token and position ids for the embeddings
    emb_mask = tokens * d * act if cfg.dropout > 0 else 0
    final_norm = tokens * d * act + 2 * tokens * 4  # input plus mean and 1/std
    head_input = tokens * d * act  # final norm output, read by the tied head
    # Cross-entropy keeps the log-probabilities and the int64 targets; the logits themselves
    # are not saved (log-softmax's backward needs only its output).
    loss = tokens * cfg.vocab_size * act + tokens * 8
    return token_ids + emb_mask + final_norm + head_input + loss


def gpt_saved_activation_bytes(
    cfg: GPTConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "fp32",
    checkpointing: bool = False,
) -> int:
    """Bytes of activations ``GPT`` saves for backward on one micro-batch, per rank.

    The count follows what ``shardwise.models.gpt`` saves, tensor by tensor, with activations
    in the compute dtype of ``precision`` (the model cast to bf16/fp16 for mixed precision).
    With ``checkpointing`` each block keeps only its input; during backward one block at a time
    is recomputed, so one block's full activations are added on top.
    """
    check_count("micro_batch", micro_batch, 1)
    check_count("seq_len", seq_len, 1)
    check_precision(precision)
    if seq_len > cfg.seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's seq_len={cfg.seq_len}")
    act = BYTES_PER_ELEMENT[precision]
    tokens = micro_batch * seq_len
    block = _block_bytes(cfg, tokens, micro_batch, seq_len, act)
    outside = _outside_bytes(cfg, tokens, seq_len, act)
    if checkpointing:
        block_input = tokens * cfg.d_model * act
        # The recomputed block's own input is one of the kept block inputs: count it once.
        return cfg.n_layer * block_input + (block - block_input) + outside
    return cfg.n_layer * block + outside

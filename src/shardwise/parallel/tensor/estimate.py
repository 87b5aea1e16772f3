"""Memory per rank under tensor (and sequence) parallelism, for the built-in GPT.

Model states: the layers ``tp_plan()`` splits hold 1/tp of their elements per rank (the
vocabulary padded up to a multiple of tp); norms, the position embedding and row-parallel
biases stay whole; ZeRO then shards what each rank holds over the dp ranks.

Activations per transformer layer follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sec. 4, eq. 1-4 and Table 2) for s tokens per
sequence, b sequences, h hidden, a heads, t = tp, 16-bit activations and 1-byte dropout masks:

    no parallelism               s·b·h·(34 + 5·a·s/h)
    tensor parallel              s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel   s·b·h·(34 + 5·a·s/h) / t
    + selective recompute        s·b·h·34 / t        (s·b·h·(10 + 24/t) without SP)
    full recompute               2·s·b·h             (÷ t with SP)
"""

from __future__ import annotations

import math
from fractions import Fraction

from shardwise.models.gpt import GPTConfig

RECOMPUTE = ("none", "selective", "full")


def gpt_block_params_per_rank(cfg: GPTConfig, tp: int) -> tuple[int, int]:
    """``(sharded, replicated)`` parameter elements of one transformer block per tp rank."""
    if tp < 1 or cfg.n_head % tp or cfg.d_model % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide n_head={cfg.n_head} and d_model")
    d, b = cfg.d_model, int(cfg.bias)
    split_block = 3 * (d * d + b * d) + d * d + (4 * d * d + 4 * b * d) + 4 * d * d
    whole_block = 2 * (d + b * d) + 2 * b * d  # two norms, the row-parallel biases
    return split_block // tp, whole_block


def gpt_params_per_rank(cfg: GPTConfig, tp: int) -> tuple[int, int]:
    """``(sharded, replicated)`` parameter elements one tp rank of ``GPT(cfg)`` holds."""
    split_block, whole_block = gpt_block_params_per_rank(cfg, tp)
    d, b = cfg.d_model, int(cfg.bias)
    vocab_rows = math.ceil(cfg.vocab_size / tp)  # the tied head shares these rows
    sharded = vocab_rows * d + cfg.n_layer * split_block
    replicated = cfg.seq_len * d + cfg.n_layer * whole_block + (d + b * d)
    return sharded, replicated


def layer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> int:
    """Bytes of activations one transformer layer keeps per tp rank (Korthikanti et al.)."""
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
    return math.ceil(per)


def gpt_activation_bytes(
    cfg: GPTConfig,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> int:
    """``n_layer`` times the per-layer formula (embeddings and loss not included)."""
    per = layer_activation_bytes(
        seq_len, micro_batch, cfg.d_model, cfg.n_head, tp, sequence_parallel, recompute
    )
    return cfg.n_layer * per

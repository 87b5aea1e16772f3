"""Memory per rank under tensor (and sequence) parallelism, for the built-in GPT.

The arithmetic lives in ``shardwise.costmodel``: ``memory.gpt_params_per_rank`` (the layers
``tp_plan()`` splits hold 1/tp of their elements, the vocabulary padded up to a multiple of tp)
and ``activations.layer_activation_bytes`` (Korthikanti et al. 2022 per layer and tp rank).
"""

from __future__ import annotations

from shardwise.costmodel.activations import RECOMPUTE, layer_activation_bytes
from shardwise.costmodel.memory import gpt_block_params_per_rank, gpt_params_per_rank
from shardwise.models.gpt import GPTConfig

__all__ = [
    "RECOMPUTE",
    "gpt_activation_bytes",
    "gpt_block_params_per_rank",
    "gpt_params_per_rank",
    "layer_activation_bytes",
]


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

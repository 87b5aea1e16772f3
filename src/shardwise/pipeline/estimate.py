"""Memory per pipeline rank of the built-in GPT, before anything runs.

Model states: the ``n_layer`` blocks are split evenly over the ``pp`` ranks (the first
``n_layer % pp`` ranks one more); the first rank also holds the token and position embeddings,
the last the final norm and a copy of the tied head (the token embedding's weight). Under
tensor parallelism each rank holds its tp share (``shardwise.costmodel.memory``).

Activations: a rank keeps the activations of every micro-batch it has run forward but not yet
backward. The peak of those in flight comes from the schedule's simulator
(``shardwise.pipeline.simulate``): ``m`` for GPipe, ``min(pp - r, m)`` for 1F1B on rank ``r``,
whatever the simulator finds for interleaved 1F1B and ZB-H1 (a chunk of an interleaved schedule
holds ``1/v`` of the rank's layers). Times the per-layer, per-micro-batch activation bytes of
Korthikanti et al. 2022 (``costmodel.activations.layer_activation_bytes``) times the rank's
blocks; embeddings and the loss are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from shardwise.costmodel.activations import (
    RECOMPUTE,
    in_flight_activation_bytes,
    layer_activation_bytes,
)
from shardwise.costmodel.memory import blocks_per_rank, gpt_params_per_pp_rank
from shardwise.models.gpt import GPTConfig
from shardwise.pipeline.simulate import simulate

__all__ = [
    "PipelineRankEstimate",
    "blocks_per_rank",
    "gpt_params_per_pp_rank",
    "gpt_pipeline_estimate",
    "peak_in_flight",
]


@dataclass(frozen=True)
class PipelineRankEstimate:
    """One pp rank (per tp rank) of a pipelined GPT."""

    pp_rank: int
    blocks: int
    """Transformer blocks this rank holds."""
    params: int
    """Parameter elements this rank holds (its tp share; before ZeRO over dp)."""
    in_flight: Fraction
    """Peak micro-batches whose activations this rank keeps, in units of one micro-batch
    through all of its blocks."""
    activation_bytes: dict[str, int]
    """Peak activation bytes per recompute mode (``costmodel.activations.RECOMPUTE``)."""


def peak_in_flight(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
) -> list[Fraction]:
    """Per pp rank, the most micro-batches in flight (through all of the rank's layers) at once
    in ``schedule``, from the simulator."""
    result = simulate(schedule, pp, microbatches, virtual_stages=virtual_stages)
    return [result.peak_activations(r) for r in range(pp)]


def gpt_pipeline_estimate(
    cfg: GPTConfig,
    pp: int,
    schedule: str,
    microbatches: int,
    micro_batch: int,
    seq_len: int,
    *,
    virtual_stages: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> list[PipelineRankEstimate]:
    """Every pp rank's blocks, parameters and peak activation bytes (``micro_batch``
    sequences of ``seq_len`` tokens per micro-batch, 16-bit activations)."""
    blocks = blocks_per_rank(cfg.n_layer, pp)
    if any(n % virtual_stages for n in blocks):
        raise ValueError(
            f"virtual_stages={virtual_stages} must divide every rank's blocks {blocks} "
            f"(n_layer={cfg.n_layer} over pp={pp})"
        )
    params = gpt_params_per_pp_rank(cfg, pp, tp)
    flights = peak_in_flight(schedule, pp, microbatches, virtual_stages)
    out = []
    for r in range(pp):
        act = {}
        for mode in RECOMPUTE:
            per_layer = layer_activation_bytes(
                seq_len, micro_batch, cfg.d_model, cfg.n_head, tp, sequence_parallel, mode
            )
            act[mode] = in_flight_activation_bytes(per_layer, blocks[r], flights[r])
        out.append(PipelineRankEstimate(r, blocks[r], params[r], flights[r], act))
    return out

"""Memory per pipeline rank of the built-in GPT, before anything runs.

Model states: the ``n_layer`` blocks are split evenly over the ``pp`` ranks (the first
``n_layer % pp`` ranks one more); the first rank also holds the token and position embeddings,
the last the final norm and a copy of the tied head (the token embedding's weight). Under
tensor parallelism each rank holds its tp share (``shardwise.costmodel.tp_memory``).

Activations: a rank keeps the activations of every micro-batch it has run forward but not yet
backward. The peak of those in flight comes from the schedule's simulator
(``shardwise.parallel.pipeline.simulate``): ``m`` for GPipe, ``min(pp - r, m)`` for 1F1B on rank
``r``, whatever the simulator finds for interleaved 1F1B and ZB-H1 (a chunk of an interleaved
schedule holds ``1/v`` of the rank's layers). Times the per-layer, per-micro-batch activation bytes
of Korthikanti et al. 2022 (``tp_memory.layer_activation_bytes``) times the rank's blocks;
embeddings and the loss are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from shardwise.costmodel import tp_memory as tp_estimate
from shardwise.models.gpt import GPTConfig
from shardwise.parallel.pipeline.schedule import Kind
from shardwise.parallel.pipeline.simulate import simulate


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
    """Peak activation bytes per recompute mode (``tp.estimate.RECOMPUTE``)."""


def blocks_per_rank(n_layer: int, pp: int) -> list[int]:
    """``n_layer`` blocks over ``pp`` ranks, the first ``n_layer % pp`` ranks one more."""
    if not 1 <= pp <= n_layer:
        raise ValueError(f"pp={pp} must be in 1..n_layer={n_layer}: each stage needs a block")
    return [n_layer // pp + (r < n_layer % pp) for r in range(pp)]


def blocks_per_stage(n_layer: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """``n_layer`` blocks over the ``pp x virtual_stages`` stages (stage ``s`` on rank
    ``s % pp``), the first stages one more; each stage needs a block."""
    stages = pp * virtual_stages
    if not 1 <= stages <= n_layer:
        raise ValueError(
            f"pp={pp} x virtual_stages={virtual_stages} = {stages} stages must be in "
            f"1..n_layer={n_layer}: each stage needs a block"
        )
    return blocks_per_rank(n_layer, stages)


def _rank_blocks(stage_blocks: list[int], pp: int) -> list[int]:
    return [sum(stage_blocks[r::pp]) for r in range(pp)]


def gpt_params_per_pp_rank(
    cfg: GPTConfig, pp: int, tp: int = 1, virtual_stages: int = 1
) -> list[int]:
    """Parameter elements each pp rank of ``GPT(cfg)`` holds per tp rank. Over all ranks they
    sum to the model's (per tp rank) plus, at pp > 1, the tied head's copy of the token
    embedding on the last rank."""
    block = sum(tp_estimate.gpt_block_params_per_rank(cfg, tp))
    d, b = cfg.d_model, int(cfg.bias)
    vocab = math.ceil(cfg.vocab_size / tp) * d  # the token embedding's rows, tp-split
    blocks = _rank_blocks(blocks_per_stage(cfg.n_layer, pp, virtual_stages), pp)
    out = [n * block for n in blocks]
    out[0] += vocab + cfg.seq_len * d
    out[-1] += d + b * d + (vocab if pp > 1 else 0)
    return out


def peak_in_flight(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
) -> list[Fraction]:
    """Per pp rank, the most micro-batches in flight (through all of the rank's layers) at once
    in ``schedule``, from the simulator."""
    result = simulate(schedule, pp, microbatches, virtual_stages=virtual_stages)
    return [result.peak_activations(r) for r in range(pp)]


def peak_blocks_in_flight(
    schedule: str, pp: int, microbatches: int, stage_blocks: list[int]
) -> list[int]:
    """Per pp rank, the most (block, micro-batch) activations held at once in ``schedule``:
    the simulator's timeline replayed, a forward through stage ``s`` adding its
    ``stage_blocks[s]`` blocks, its backward (B or I) releasing them."""
    virtual_stages = len(stage_blocks) // pp
    result = simulate(schedule, pp, microbatches, virtual_stages=virtual_stages)
    peaks = []
    for row in result.timeline:
        held = peak = 0
        for slot in row:
            a = slot.action
            if a.kind is Kind.F:
                held += stage_blocks[a.stage]
            elif a.kind in (Kind.B, Kind.I):
                held -= stage_blocks[a.stage]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


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
    sequences of ``seq_len`` tokens per pipeline micro-batch, 16-bit activations). A rank's
    chunks may hold different numbers of blocks (``blocks_per_stage``)."""
    stage_blocks = blocks_per_stage(cfg.n_layer, pp, virtual_stages)
    blocks = _rank_blocks(stage_blocks, pp)
    params = gpt_params_per_pp_rank(cfg, pp, tp, virtual_stages)
    peaks = peak_blocks_in_flight(schedule, pp, microbatches, stage_blocks)
    out = []
    for r in range(pp):
        act = {}
        for mode in tp_estimate.RECOMPUTE:
            per_layer = tp_estimate.layer_activation_bytes(
                seq_len, micro_batch, cfg.d_model, cfg.n_head, tp, sequence_parallel, mode
            )
            act[mode] = math.ceil(peaks[r] * per_layer)
        flight = Fraction(peaks[r], blocks[r])
        out.append(PipelineRankEstimate(r, blocks[r], params[r], flight, act))
    return out

"""Every plan for a device count, ranked by predicted throughput; weak scaling over counts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from shardwise.costmodel.hardware import Hardware
from shardwise.costmodel.plan import Plan
from shardwise.costmodel.predict import Prediction, predict, ring_seconds
from shardwise.costmodel.shapes import ModelShape

MICRO_BATCHES = tuple(2**k for k in range(9))  # 1 .. 256 sequences; memory rules out the rest


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_plans(shape: ModelShape, devices: int, hw: Hardware, global_batch: int) -> list[Plan]:
    """tp inside a node and dividing the heads, pp dividing the layers, every micro-batch size,
    schedule, ZeRO stage and recomputation; sequence parallelism whenever tp > 1."""
    plans = []
    for tp in _divisors(devices):
        if tp > hw.devices_per_node or shape.heads % tp:
            continue
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            if shape.layers % pp or global_batch % dp:
                continue
            scheds = [("1f1b", 1)]
            if pp > 1:
                scheds += [("zb-h1", 1)] + (
                    [("interleaved", 2)] if shape.layers % (2 * pp) == 0 else []
                )
            for b, (sched, v), zero, rec in itertools.product(
                MICRO_BATCHES, scheds, (0, 1, 2, 3), ("none", "selective", "full")
            ):
                per_rank = global_batch // dp
                if per_rank % b:
                    continue
                plans.append(
                    Plan(
                        dp=dp,
                        tp=tp,
                        pp=pp,
                        schedule=sched,
                        virtual_stages=v,
                        micro_batches=per_rank // b,
                        micro_batch=b,
                        zero_stage=zero,
                        sequence_parallel=tp > 1,
                        recompute=rec,
                    )
                )
    return plans


def rank_plans(
    shape: ModelShape, devices: int, hw: Hardware, global_batch: int, top: int = 10
) -> list[Prediction]:
    """The ``top`` plans that fit in memory, fastest first (tokens/s per device)."""
    if devices < 1 or global_batch < 1:
        raise ValueError(f"devices and global_batch must be >= 1, got {devices}, {global_batch}")
    preds = [predict(shape, p, hw) for p in candidate_plans(shape, devices, hw, global_batch)]
    fitting = sorted((p for p in preds if p.fits), key=lambda p: -p.tokens_per_s_per_device)
    return fitting[:top]


@dataclass(frozen=True)
class ScalingPoint:
    devices: int
    best: Prediction | None  # None: no plan fits
    efficiency: float  # tokens/s per device over the smallest count's
    exposed_comm: float  # (tp + p2p + dp) / step
    allreduce_busbw: float  # bytes/s of the gradient all-reduce over dp (nccl-tests busbw)


def scaling(
    shape: ModelShape, hw: Hardware, counts: list[int], sequences_per_device: int
) -> list[ScalingPoint]:
    """Weak scaling: at each device count the best plan with ``sequences_per_device`` per
    device and step; efficiency relative to the first count where a plan fits."""
    points: list[ScalingPoint] = []
    base = None
    for n in counts:
        ranked = rank_plans(shape, n, hw, sequences_per_device * n, top=1)
        best = ranked[0] if ranked else None
        if best is None:
            points.append(ScalingPoint(n, None, 0.0, 0.0, 0.0))
            continue
        base = base or best.tokens_per_s_per_device
        b = best.breakdown
        comm = (b["tp"] + b["p2p"] + b["dp"]) / best.step_s
        points.append(
            ScalingPoint(
                n, best, best.tokens_per_s_per_device / base, comm, _busbw(shape, best, hw)
            )
        )
    return points


def _busbw(shape: ModelShape, pred: Prediction, hw: Hardware) -> float:
    """nccl-tests busbw of an all-reduce of this plan's gradients over dp: 2(n-1)/n S / t."""
    plan = pred.plan
    if plan.dp == 1:
        return 0.0
    nbytes = shape.params() / (plan.tp * plan.pp) * 4
    seconds = ring_seconds(hw.link(plan.tp, plan.dp), nbytes, plan.dp)
    return 2 * (plan.dp - 1) / plan.dp * nbytes / seconds

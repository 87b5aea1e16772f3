"""Every plan for a device count, ranked by predicted throughput; weak scaling over counts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from shardwise.costmodel.hardware import Hardware
from shardwise.costmodel.plan import CP_METHODS, Plan
from shardwise.costmodel.predict import Prediction, predict, ring_seconds
from shardwise.costmodel.shapes import ModelShape
from shardwise.parallel.layout import (
    PLAN_FLAGS,
    Flags,
    Layout,
    ModelDims,
    check_layout,
    divisors,
)

MAX_GLOBAL_BATCH = 1 << 20
"""Most sequences per step ``rank_plans`` plans (1,048,576: a billion tokens at 1024 each)."""
MAX_SCALING_POINTS = 64
"""Most device counts one weak-scaling curve evaluates."""

SCALING_FLAGS = Flags(world="--scaling device count")

MICRO_BATCHES = tuple(2**k for k in range(9))  # 1 .. 256 sequences; memory rules out the rest
SCHEDULE_NAMES = {"1f1b": "1f1b", "zb-h1": "zb_h1", "interleaved": "interleaved_1f1b"}
"""The cost model's schedule names -> the pipeline's (``shardwise.parallel.pipeline.schedule``)."""


def model_dims(shape: ModelShape) -> ModelDims:
    """What of ``shape`` a layout must split evenly."""
    return ModelDims(
        name=shape.name,
        n_layer=shape.layers,
        n_head=shape.heads,
        d_model=shape.hidden,
        seq_len=shape.seq_len,
    )


def _valid(
    layout: Layout, dims: ModelDims, micro_batch: int | None = None, global_batch: int | None = None
) -> bool:
    try:
        check_layout(
            layout, model=dims, micro_batch=micro_batch, global_batch=global_batch, flags=PLAN_FLAGS
        )
    except ValueError:
        return False
    return True


def _layouts(
    shape: ModelShape, devices: int, hw: Hardware, global_batch: int
) -> list[tuple[int, int, int, str]]:
    """(tp, pp, cp, cp method) the shared layout check accepts, with tp inside a node and pp
    dividing the layers (the cost model splits them evenly). Raises the check's
    ``ValueError`` for plain data parallelism when none is valid: it names what would work."""
    dims, pairs = model_dims(shape), []
    for tp in divisors(devices):
        if tp > hw.devices_per_node:
            continue
        for pp, cp, method in itertools.product(
            divisors(devices // tp), divisors(devices // tp), CP_METHODS
        ):
            if (devices // tp) % (pp * cp) or (cp == 1 and method != "ring"):
                continue
            layout = Layout(world_size=devices, tp=tp, pp=pp, cp=cp, cp_method=method,
                            sequence_parallel=tp > 1)  # fmt: skip
            if shape.layers % pp == 0 and _valid(layout, dims, global_batch=global_batch):
                pairs.append((tp, pp, cp, method))
    if not pairs:
        plain = Layout(world_size=devices)
        check_layout(plain, model=dims, global_batch=global_batch, flags=PLAN_FLAGS)
    return pairs


def candidate_plans(shape: ModelShape, devices: int, hw: Hardware, global_batch: int) -> list[Plan]:
    """tp inside a node and dividing the heads, pp dividing the layers, cp splitting the
    sequence (either method), every micro-batch size,
    schedule, ZeRO stage and recomputation; sequence parallelism whenever tp > 1. Layouts go
    through ``shardwise.parallel.layout.check_layout``, as ``train``'s do."""
    plans = []
    for tp, pp, cp, method in _layouts(shape, devices, hw, global_batch):
        dp = devices // (tp * pp * cp)
        per_rank = global_batch // dp
        scheds = [("1f1b", 1)]
        if pp > 1:
            scheds += [("zb-h1", 1)] + (
                [("interleaved", 2)] if shape.layers % (2 * pp) == 0 else []
            )
        for b, (sched, v) in itertools.product(MICRO_BATCHES, scheds):
            if per_rank % b:
                continue
            m = per_rank // b
            pipe = Layout(world_size=devices, tp=tp, pp=pp, cp=cp, cp_method=method,
                          schedule=SCHEDULE_NAMES[sched], microbatches=m,
                          virtual_stages=v)  # fmt: skip
            if pp > 1 and not _valid(pipe, model_dims(shape), micro_batch=per_rank):
                continue
            for zero, rec in itertools.product((0, 1, 2, 3), ("none", "selective", "full")):
                plans.append(
                    Plan(dp=dp, tp=tp, pp=pp, schedule=sched, virtual_stages=v, micro_batches=m,
                         micro_batch=b, zero_stage=zero, sequence_parallel=tp > 1, recompute=rec,
                         cp=cp, cp_method=method)
                )  # fmt: skip
    return plans


def rank_plans(
    shape: ModelShape, devices: int, hw: Hardware, global_batch: int, top: int = 10
) -> list[Prediction]:
    """The ``top`` plans that fit in memory, fastest first (tokens/s per device); empty when
    none fits. Raises ``ValueError`` naming the reason when no layout splits the model and
    the batch over ``devices`` at all, or an input is out of bounds."""
    if not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise ValueError(f"--global-batch must be in 1..{MAX_GLOBAL_BATCH:,}, got {global_batch}")
    if top < 1:
        raise ValueError(f"--top must be >= 1, got {top}")
    check_layout(Layout(world_size=devices), flags=PLAN_FLAGS)  # the bounds, before any search
    preds = [predict(shape, p, hw) for p in candidate_plans(shape, devices, hw, global_batch)]
    fitting = sorted((p for p in preds if p.fits), key=lambda p: -p.tokens_per_s_per_device)
    return fitting[:top]


@dataclass(frozen=True)
class ScalingPoint:
    devices: int
    best: Prediction | None  # None: no plan fits
    efficiency: float  # tokens/s per device over the smallest count's
    exposed_comm: float  # (tp + p2p + dp + cp) / step
    allreduce_busbw: float  # bytes/s of the gradient all-reduce over dp (nccl-tests busbw)


def scaling(
    shape: ModelShape, hw: Hardware, counts: list[int], sequences_per_device: int
) -> list[ScalingPoint]:
    """Weak scaling: at each device count the best plan with ``sequences_per_device`` per
    device and step; efficiency relative to the first count where a plan fits. At most
    ``MAX_SCALING_POINTS`` counts, each in 1..``MAX_DEVICES``."""
    if not 1 <= len(counts) <= MAX_SCALING_POINTS:
        raise ValueError(
            f"--scaling takes 1..{MAX_SCALING_POINTS} device counts, got {len(counts)}"
        )
    for n in counts:
        check_layout(Layout(world_size=n), flags=SCALING_FLAGS)
    if sequences_per_device < 1 or sequences_per_device * max(counts) > MAX_GLOBAL_BATCH:
        raise ValueError(
            f"--sequences-per-device {sequences_per_device} x {max(counts)} devices must be "
            f"in 1..{MAX_GLOBAL_BATCH:,} sequences per step"
        )
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
        comm = (b["tp"] + b["p2p"] + b["dp"] + b["cp"]) / best.step_s
        points.append(
            ScalingPoint(
                n, best, best.tokens_per_s_per_device / base, comm, _busbw(shape, best, hw)
            )
        )
    return points


def _busbw(shape: ModelShape, pred: Prediction, hw: Hardware) -> float:
    """nccl-tests busbw of an all-reduce of this plan's gradients over dp (x cp): 2(n-1)/n S /
    t."""
    plan, n = pred.plan, pred.plan.zero_ranks
    if n == 1:
        return 0.0
    nbytes = shape.params() / (plan.tp * plan.pp) * 4
    seconds = ring_seconds(hw.link(plan.tp, n), nbytes, n)
    return 2 * (n - 1) / n * nbytes / seconds

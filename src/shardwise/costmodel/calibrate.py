"""Calibrating the cost model's collectives where they run: time each collective over a sweep of
sizes (as nccl-tests does) and fit the alpha-beta of one ring step to the times.

A ring collective of S bytes over n ranks takes ``steps * (alpha + S/n * beta)``: 2(n-1) steps
for all_reduce, n-1 for all_gather (S: the gathered output) and reduce_scatter (S: the input).
The fit minimizes the relative error over the sweep, so small and large messages weigh alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from shardwise.comm import Group, ops
from shardwise.comm.allreduce_rounds import GroupLinks, LinkCost, predict_seconds

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


def ring_steps(op: str, n: int) -> int:
    """Ring steps of collective ``op`` over ``n`` ranks (each moves S/n bytes)."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(COLLECTIVES)}")
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def fit_ring_step(op: str, n: int, sizes: Sequence[int], seconds: Sequence[float]) -> LinkCost:
    """The (alpha, beta) >= 0 of one ring step that best explain ``seconds`` of ``op`` at
    ``sizes`` bytes over ``n`` ranks, by least relative squares."""
    if n < 2:
        raise ValueError(f"a ring step needs n >= 2 ranks, got {n}")
    if len(sizes) != len(seconds) or len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("fit_ring_step needs times at two or more different sizes")
    if min(seconds) <= 0 or min(sizes) <= 0:
        raise ValueError("sizes and seconds must be > 0")
    steps = ring_steps(op, n)
    alpha, beta = _weighted_line([s / n for s in sizes], [t / steps for t in seconds])
    return LinkCost(alpha, beta)


def _weighted_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(a, b) >= 0 of y = a + b x by least squares of the relative error (weights 1/y^2); a
    negative coefficient is dropped and the other refitted alone."""
    ws = [1.0 / y**2 for y in ys]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs, strict=True))
    sy = sum(w * y for w, y in zip(ws, ys, strict=True))
    sxx = sum(w * x * x for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
    det = sw * sxx - sx * sx
    alpha = (sxx * sy - sx * sxy) / det
    beta = (sw * sxy - sx * sy) / det
    if alpha < 0:  # through the origin: bandwidth only
        alpha, beta = 0.0, sxy / sxx
    elif beta < 0:  # latency only
        alpha, beta = sy / sw, 0.0
    return alpha, beta


def _clock(dev: torch.device) -> float:
    """Now, after the device's queued work (timings of GPU work need the synchronize)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _seconds_per_call(
    group: Group, dev: torch.device, work: Callable[[], object], reps: int = 1
) -> float:
    """Seconds per call of ``work``, run ``reps`` times back to back after a barrier: the
    slowest rank's (collective)."""
    ops.barrier(group=group)
    t0 = _clock(dev)
    for _ in range(reps):
        work()
    took = torch.tensor([(_clock(dev) - t0) / reps], dtype=torch.float64, device=dev)
    ops.all_reduce(took, "max", group=group)
    return float(took.item())


def _once(op: str, group: Group, full: torch.Tensor, shard: torch.Tensor) -> float:
    """One collective after a barrier; the slowest rank's seconds."""
    if op == "all_reduce":
        work = partial(ops.all_reduce, full, "sum", group=group)
    elif op == "all_gather":  # into a buffer, as ZeRO gathers into its flat parameters
        work = partial(ops.all_gather, shard, group=group, out=full)
    else:  # into a buffer, as ZeRO reduces into its gradient shard (a fresh 32 MiB+ buffer
        # would add the page faults of a new mapping to every call)
        work = partial(ops.reduce_scatter, full, "sum", group=group, out=shard)
    return _seconds_per_call(group, full.device, work)


def repeats_per_turn(nbytes: float, equal_time_bytes: float) -> int:
    """How many times a message of ``nbytes`` is timed per turn so that its turn lasts about as
    long as one of ``equal_time_bytes`` (0: once): a small message's times spread wider."""
    return max(1, round(equal_time_bytes / nbytes)) if equal_time_bytes > 0 else 1


def timed_bytes(nbytes: int, n: int) -> int:
    """The fp32 bytes timed for a requested ``nbytes`` over ``n`` ranks: a multiple of ``n``
    elements, at least ``n``."""
    return max(n, nbytes // 4 // n * n) * 4


def sample_collectives(
    group: Group,
    sizes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 5,
    ops: Sequence[str] = COLLECTIVES,
    equal_time_bytes: int = 0,
) -> dict[tuple[str, int], list[float]]:
    """Every timed sample (the slowest rank's seconds) of each fp32 collective at each size,
    keyed ``(op, requested bytes)``, after one untimed turn. Sizes and collectives take turns,
    so background load hits all alike (tensors on the current world's device: CUDA on NCCL); a
    size below ``equal_time_bytes`` is timed about
    ``equal_time_bytes / size`` times per turn (a small message's times spread wider).
    Collective: every rank of ``group`` calls it."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if len(set(sizes)) != len(sizes) or min(sizes, default=1) <= 0:
        raise ValueError(f"sizes must be distinct byte counts > 0, got {list(sizes)}")
    for op in ops:
        ring_steps(op, 2)  # refuses an unknown op
    n, dev = group.size, group.world.device
    buffers = {}
    for nbytes in sizes:
        numel = timed_bytes(nbytes, n) // 4
        buffers[nbytes] = (torch.ones(numel, device=dev), torch.ones(numel // n, device=dev))
    samples: dict[tuple[str, int], list[float]] = {(op, s): [] for s in sizes for op in ops}
    for it in range(iters + 1):
        for nbytes, (full, shard) in buffers.items():
            for _ in range(repeats_per_turn(nbytes, equal_time_bytes)):
                for op in ops:
                    seconds = _once(op, group, full, shard)
                    if it:
                        samples[op, nbytes].append(seconds)
    return samples


def time_collectives(
    group: Group,
    sizes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 5,
    ops: Sequence[str] = COLLECTIVES,
) -> dict[str, list[float]]:
    """Median seconds (the slowest rank's) of each fp32 collective at each size in bytes
    (``sample_collectives``). Collective: every rank of ``group`` calls it."""
    samples = sample_collectives(group, sizes, iters, ops)
    return {op: [statistics.median(samples[op, s]) for s in sizes] for op in ops}


def fit_collectives(
    group: Group, sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 5
) -> dict[str, LinkCost]:
    """Per collective, the ring step fitted to its timed sweep over ``group`` (collective):
    ``Hardware.collectives`` for ``costmodel.measured``."""
    if group.size < 2:
        raise ValueError("fit_collectives needs a group of two or more ranks")
    times = time_collectives(group, sizes, iters)
    sized = [timed_bytes(s, group.size) for s in sizes]
    return {op: fit_ring_step(op, group.size, sized, t) for op, t in times.items()}


def fit_schedule_link(
    algorithm: str, p: int, sizes: Sequence[int], seconds: Sequence[float], duplex: bool = True
) -> LinkCost:
    """The (alpha, beta) >= 0 of the link inside one node that best explain ``seconds`` of the
    comm layer's all_reduce ``algorithm`` (``comm.allreduce_rounds``) of fp32 ``sizes`` bytes over
    ``p`` ranks of that node, by least relative squares. ``duplex`` as ``LinkCost.duplex``."""
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError("fit_schedule_link needs times at two or more different sizes")
    nodes = (0,) * p

    def unit(alpha: float, beta: float, nbytes: int) -> float:
        link = LinkCost(alpha, beta, duplex)
        return predict_seconds(algorithm, nbytes, 4, GroupLinks(nodes, link, link))

    # seconds = rounds * alpha + bytes * beta: the same weighted fit as one ring step's
    rounds = [unit(1.0, 0.0, s) for s in sizes]
    volume = [unit(0.0, 1.0, s) for s in sizes]
    per_round = [t / r for t, r in zip(seconds, rounds, strict=True)]
    x = [v / r for v, r in zip(volume, rounds, strict=True)]
    alpha, beta = _weighted_line(x, per_round)
    return LinkCost(alpha, beta, duplex)


SYNC_SEGMENTS_S = (0.02, 0.05, 0.1)


def measure_sync_loss(
    group: Group,
    segments_s: Sequence[float] = SYNC_SEGMENTS_S,
    nbytes: int = 1 << 20,
    reps: int = 8,
    rounds: int = 5,
) -> float:
    """``Hardware.sync_loss`` over ``group`` (collective): the share of the compute between two
    blocking all_reduces that the ranks lose meeting at them.

    For each segment length (a square matmul sized to take about that long, at most 4096 wide;
    the fit uses the lengths measured), in turns: ``reps``
    segments back to back (the ranks meet once, after them), ``reps`` all_reduces of
    ``nbytes`` back to back, and ``reps`` of segment-then-all_reduce. The loss at a length is
    (third - first - second) / first, per call, from the medians over ``rounds`` of the slowest
    rank's times; the result is fitted through the origin over the lengths, at least 0."""
    if reps < 1 or rounds < 1 or not segments_s or min(segments_s) <= 0:
        raise ValueError("measure_sync_loss needs reps >= 1, rounds >= 1 and segments > 0 s")
    dev = group.world.device
    probe = torch.randn(256, 256, device=dev)
    probe @ probe
    rate = 2 * 256**3 / _seconds_per_call(group, dev, lambda: probe @ probe)  # same on all ranks
    sides = [min(4096, max(64, round((seg * rate / 2) ** (1 / 3)))) for seg in segments_s]
    mats = [(torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)) for n in sides]
    buf = torch.ones(max(1, nbytes // 4), device=dev)
    runs: list[dict[str, list[float]]] = [{"c": [], "a": [], "ca": []} for _ in sides]

    reduce = partial(ops.all_reduce, buf, "sum", group=group)

    def segment(a: torch.Tensor, b: torch.Tensor, then_reduce: bool) -> None:
        a @ b
        if then_reduce:
            reduce()

    for it in range(rounds + 1):
        for (a, b), run in zip(mats, runs, strict=True):
            times = {
                "c": _seconds_per_call(group, dev, partial(segment, a, b, False), reps),
                "a": _seconds_per_call(group, dev, reduce, reps),
                "ca": _seconds_per_call(group, dev, partial(segment, a, b, True), reps),
            }
            if it:
                for k, v in times.items():
                    run[k].append(v)
    seg = [statistics.median(r["c"]) for r in runs]
    lost = [statistics.median(r["ca"]) - statistics.median(r["a"]) - c for r, c in zip(runs, seg)]
    return max(0.0, sum(s * x for s, x in zip(seg, lost)) / sum(s * s for s in seg))

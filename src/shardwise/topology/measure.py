"""The link between every pair of ranks, measured by ping-pong and fitted to alpha-beta."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

from shardwise.comm import objects, ops
from shardwise.comm.groups import Group
from shardwise.topology.model import LinkFit

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # bytes


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float]) -> LinkFit:
    """Fit ``seconds = alpha + size * beta``: the line through the smallest message's time (the
    latency, which a least-squares intercept set by the large messages misses) whose slope
    minimises the squared error of every point; alpha is kept >= 0. R² is the plain
    coefficient of determination over the points."""
    if len(sizes) != len(seconds) or len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("fit_alpha_beta needs at least two distinct sizes, one time per size")
    if min(seconds) <= 0:
        raise ValueError(f"fit_alpha_beta: times must be > 0, got {list(seconds)}")
    x0, y0 = min(zip(sizes, seconds))
    beta = sum((x - x0) * (y - y0) for x, y in zip(sizes, seconds)) / sum(
        (x - x0) ** 2 for x in sizes
    )
    beta = max(beta, 0.0)
    alpha = max(y0 - beta * x0, 0.0)
    mean = statistics.fmean(seconds)
    ss_tot = sum((y - mean) ** 2 for y in seconds)
    ss_res = sum((y - alpha - beta * x) ** 2 for x, y in zip(sizes, seconds))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LinkFit(alpha, beta, r2)


def pair_rounds(p: int) -> list[tuple[int, int]]:
    """Every unordered pair of ``p`` ranks once, in a fixed order every rank computes alike."""
    return [(i, j) for i in range(p) for j in range(i + 1, p)]


def _round_trip(g: Group, peer: int, starts: bool, buf: torch.Tensor) -> float:
    t0 = time.perf_counter()
    if starts:
        ops.send(buf, peer, group=g)
        ops.recv(buf, peer, group=g)
    else:
        ops.recv(buf, peer, group=g)
        ops.send(buf, peer, group=g)
    return time.perf_counter() - t0


def _ping_pong(
    g: Group, peer: int, starts: bool, bufs: Sequence[torch.Tensor], reps: int
) -> tuple[float, ...]:
    """Fastest one-way seconds per buffer over ``reps`` round trips with global rank ``peer``
    (after one warm-up); only the starting side's figures are meaningful. Sizes take turns
    within each repetition so that a burst of load from elsewhere hits every size alike, and
    the minimum is kept: on a shared machine such noise only ever adds time."""
    best = [float("inf")] * len(bufs)
    for rep in range(reps + 1):
        for k, buf in enumerate(bufs):
            seconds = _round_trip(g, peer, starts, buf) / 2
            if rep:
                best[k] = min(best[k], seconds)
    return tuple(best)


def measure_links(
    g: Group, sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 10
) -> list[tuple[int, int, tuple[float, ...]]]:
    """Ping-pong every pair of ``g``'s ranks at every size, one pair at a time (the others wait
    at a barrier, so pairs do not share the machine). Returns, on every rank, ``(i, j, one-way
    seconds per size)`` for every pair (group ranks).

    Communicates: per pair and size ``2 (reps + 1)`` messages of that size, one barrier per
    pair, and one all_gather_object of the results.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    bad = [s for s in sizes if not isinstance(s, int) or s < 4 or s % 4]
    if bad or len(set(sizes)) < 2:
        raise ValueError(f"sizes must be >= 2 distinct byte counts, multiples of 4; bad: {bad}")
    mine: list[tuple[int, int, tuple[float, ...]]] = []
    bufs = {s: torch.zeros(s // 4, dtype=torch.float32) for s in sizes}
    for i, j in pair_rounds(g.size):
        if g.rank in (i, j):
            peer = g.ranks[j if g.rank == i else i]
            row = _ping_pong(g, peer, g.rank == i, [bufs[s] for s in sizes], reps)
            if g.rank == i:
                mine.append((i, j, row))
        ops.barrier(group=g)
    gathered = objects.all_gather_object(mine, group=g)
    return [entry for part in gathered for entry in part]


def link_matrix(
    p: int, sizes: Sequence[int], measured: list[tuple[int, int, tuple[float, ...]]]
) -> tuple[list[list[LinkFit | None]], list[list[tuple[float, ...] | None]]]:
    """Symmetric matrices of fits and samples from ``measure_links``' rows."""
    fits: list[list[LinkFit | None]] = [[None] * p for _ in range(p)]
    samples: list[list[tuple[float, ...] | None]] = [[None] * p for _ in range(p)]
    for i, j, row in measured:
        if not all(math.isfinite(t) and t > 0 for t in row):
            raise ValueError(f"link {i}-{j}: bad timings {row}")
        fit = fit_alpha_beta(list(sizes), list(row))
        fits[i][j] = fits[j][i] = fit
        samples[i][j] = samples[j][i] = row
    return fits, samples

"""Where to cut a list of layers into pipeline stages."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

PARTITIONS = ("parameters", "uniform")


def balanced_bounds(costs: Sequence[int], parts: int) -> list[int]:
    """Contiguous split of ``costs`` into ``parts`` non-empty runs minimising the largest run's
    sum (ties: the earliest cuts). Returns ``parts + 1`` boundaries from 0 to len(costs)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max-run cost splitting the first i layers into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def partition_layers(
    param_counts: Sequence[int], parts: int, partition: str | Sequence[int]
) -> list[int]:
    """Stage boundaries (``parts + 1`` indices) for layers with these parameter counts.

    ``partition``: ``"parameters"`` balances parameter counts (a layer without parameters
    weighs as one parameter, so it still spreads), ``"uniform"`` balances layer counts, or the
    ``parts - 1`` indices where stages 1 .. parts-1 start.
    """
    n = len(param_counts)
    if n < parts:
        raise ValueError(
            f"{n} layers cannot fill {parts} pipeline stages (pp x virtual stages); "
            "each stage needs at least one layer"
        )
    if isinstance(partition, str):
        if partition not in PARTITIONS:
            raise ValueError(
                f"unknown partition {partition!r}; allowed: {', '.join(PARTITIONS)} "
                "or a list of cut indices"
            )
        costs = [max(1, c) for c in param_counts] if partition == "parameters" else [1] * n
        return balanced_bounds(costs, parts)
    cuts = list(partition)
    if any(not isinstance(c, int) or isinstance(c, bool) for c in cuts):
        raise TypeError(f"partition cut indices must be ints, got {cuts}")
    if len(cuts) != parts - 1:
        raise ValueError(
            f"partition needs {parts - 1} cut indices for {parts} stages, got {len(cuts)}: {cuts}"
        )
    bounds = [0, *cuts, n]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"partition cuts {cuts} must increase strictly within 1..{n - 1} "
            "(every stage at least one layer)"
        )
    return bounds

"""The spread of a benchmark's timings."""

from __future__ import annotations


def median_interval(xs: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median of ``xs``: the order
    statistics n/2 -/+ z*sqrt(n)/2 (the binomial's normal approximation)."""
    v = sorted(xs)
    n = len(v)
    half = z * n**0.5 / 2
    return v[max(0, int(n / 2 - half))], v[min(n - 1, -int(-(n / 2 + half) // 1))]

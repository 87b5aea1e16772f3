"""How well predicted step times order layouts as measured ones do: Spearman's rank
correlation (``shardwise plan --measure --run-top``, ``benchmarks/auto_plan.py``)."""

from __future__ import annotations


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties share their mean rank)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("rank_correlation needs two lists of the same length >= 2")

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0

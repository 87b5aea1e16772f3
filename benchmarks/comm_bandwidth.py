"""Collective bandwidth at world size 2 on gloo: shardwise's ops next to the raw torch calls.

    python benchmarks/comm_bandwidth.py [--sizes 1,16,256] [--iters 30] [--warmup 3]

For each message size (MiB, the size of the full tensor) and each op, shardwise's collective and
the torch.distributed call it stands for are timed in alternation (A B A B ...), so the machine's
background load hits both alike. Each timed iteration starts after a barrier; an iteration's time
is the slowest rank's, and the table reports the median over iterations.

Bandwidths follow nccl-tests (PERFORMANCE.md): algbw = full tensor bytes / time, and
busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for all_gather and reduce_scatter, where
the full tensor is the all_gather output and the reduce_scatter input. GB = 1e9 bytes.

Two more rows are reference exchanges, not shardwise ops: at 2 ranks, point-to-point isend/irecv
into buffers allocated once. For reduce_scatter each rank sends the other the half that rank owns
and adds the half it receives ((n-1)/n of the tensor leaves each rank, half of an all_reduce); for
all_gather the ranks swap shards. They show what gloo's transport allows for these ops.

This file calls torch.distributed directly on purpose: the raw calls are the baseline.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from provenance import source_version

import shardwise
from shardwise.testing import RankPool

log = logging.getLogger("comm_bandwidth")

MiB = 1 << 20
# torch 2.13 names these all_gather_single / reduce_scatter_single (the *_tensor names are
# deprecated aliases of the same calls); older torch has only the *_tensor names.
_raw_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_raw_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
WORLD_SIZE = 2
OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Variant:
    op: str
    system: str  # "shardwise", "raw" or "p2p" (reference exchange)
    label: str  # how the call reads in the table


VARIANTS = (
    Variant("all_reduce", "shardwise", "shardwise.all_reduce"),
    Variant("all_reduce", "raw", "dist.all_reduce"),
    Variant("all_gather", "shardwise", "shardwise.all_gather(out=)"),
    Variant("all_gather", "raw", f"dist.{_raw_all_gather.__name__}"),
    Variant("all_gather", "p2p", "dist.isend/irecv halves (2 ranks)"),
    Variant("reduce_scatter", "shardwise", "shardwise.reduce_scatter"),
    Variant("reduce_scatter", "raw", f"dist.{_raw_reduce_scatter.__name__}"),
    Variant("reduce_scatter", "p2p", "dist.isend/irecv halves + add (2 ranks)"),
)


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _callables(op: str, numel: int) -> dict[str, Callable[[], None]]:
    """One zero-argument call per variant of ``op`` on a full tensor of ``numel`` fp32."""
    n, r = dist.get_world_size(), dist.get_rank()
    shard_numel = numel // n
    if op == "all_reduce":
        # Zeros: summing them in place any number of times stays finite (the values do not
        # change what gloo does).
        t = torch.zeros(numel)
        return {
            "shardwise": lambda: shardwise.all_reduce(t, op="sum"),
            "raw": lambda: dist.all_reduce(t),
        }
    if op == "all_gather":
        shard = torch.full((shard_numel,), float(r))
        full = torch.empty(numel)

        def swap_halves() -> None:
            # What an all_gather needs at 2 ranks: one exchange of the shards.
            full[r * shard_numel : (r + 1) * shard_numel].copy_(shard)
            sent = dist.isend(shard, 1 - r)
            got = dist.irecv(full[(1 - r) * shard_numel : (2 - r) * shard_numel], 1 - r)
            sent.wait()
            got.wait()

        return {
            "shardwise": lambda: shardwise.all_gather(shard, out=full),
            "raw": lambda: _raw_all_gather(full, shard),
            "p2p": swap_halves,
        }
    full_in = torch.zeros(numel)
    out = torch.empty(shard_numel)
    peer_half = torch.empty(shard_numel)
    peer = 1 - r

    def exchange() -> None:
        # What a reduce_scatter needs at 2 ranks: send the peer its half, add the peer's copy of
        # ours. Moves (n-1)/n of the tensor per rank, half an all_reduce's traffic.
        sent = dist.isend(full_in[peer * shard_numel : (peer + 1) * shard_numel], peer)
        got = dist.irecv(peer_half, peer)
        sent.wait()
        got.wait()
        torch.add(full_in[r * shard_numel : (r + 1) * shard_numel], peer_half, out=out)

    return {
        "shardwise": lambda: shardwise.reduce_scatter(full_in, op="sum", out=out),
        "raw": lambda: _raw_reduce_scatter(out, full_in),
        "p2p": exchange,
    }


def _time_one(call: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def rank_task(sizes_mib: list[int], iters: int, warmup: int) -> dict[str, list[float]]:
    """On every rank: {"op|system|MiB": [seconds per timed iteration]}."""
    torch.set_num_threads(1)
    out: dict[str, list[float]] = {}
    for mib in sizes_mib:
        numel = mib * MiB // 4
        for op in OPS:
            calls = _callables(op, numel)
            for _ in range(warmup):
                for call in calls.values():
                    call()
            times: dict[str, list[float]] = {s: [] for s in calls}
            for _ in range(iters):
                for system, call in calls.items():  # alternate: noise hits every variant
                    times[system].append(_time_one(call))
            for system, ts in times.items():
                out[f"{op}|{system}|{mib}"] = ts
            del calls
    return out


def summarize(per_rank: list[dict[str, list[float]]], sizes_mib: list[int]) -> list[dict]:
    rows = []
    n = len(per_rank)
    for mib in sizes_mib:
        nbytes = mib * MiB
        for v in VARIANTS:
            key = f"{v.op}|{v.system}|{mib}"
            slowest = [max(ts) for ts in zip(*(r[key] for r in per_rank))]
            med = statistics.median(slowest)
            algbw = nbytes / med / 1e9
            rows.append(
                {
                    "size_mib": mib,
                    "op": v.op,
                    "system": v.system,
                    "call": v.label,
                    "median_s": med,
                    "min_s": min(slowest),
                    "algbw_gbs": algbw,
                    "busbw_gbs": algbw * bus_factor(v.op, n),
                }
            )
    raw = {(r["size_mib"], r["op"]): r for r in rows if r["system"] == "raw"}
    for r in rows:
        base = raw[(r["size_mib"], r["op"])]
        r["time_vs_raw"] = r["median_s"] / base["median_s"]
        r["busbw_vs_raw"] = r["busbw_gbs"] / base["busbw_gbs"]
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| size | call | median ms | min ms | algbw GB/s | busbw GB/s | time / raw | busbw / raw |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['size_mib']} MiB | {r['call']} | {r['median_s'] * 1e3:.2f} | "
            f"{r['min_s'] * 1e3:.2f} | {r['algbw_gbs']:.3f} | {r['busbw_gbs']:.3f} | "
            f"{r['time_vs_raw']:.2f} | {r['busbw_vs_raw']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        default="1,16,256",
        help="comma-separated full-tensor sizes in MiB (default 1,16,256)",
    )
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per op and size")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per op and size")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"--sizes must list sizes >= 1 MiB, got {args.sizes!r}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    version = source_version()  # before the ranks import shardwise
    t0 = time.perf_counter()
    pool = RankPool(WORLD_SIZE)
    try:
        per_rank = pool.run(rank_task, sizes, args.iters, args.warmup, timeout_s=1800)
    finally:
        pool.close()
    rows = summarize(per_rank, sizes)
    log.info(
        "gloo, world size %d, fp32, %d warm-up + %d timed iterations per op and size; "
        "median of the slowest rank per iteration (torch %s, shardwise %s)",
        WORLD_SIZE,
        args.warmup,
        args.iters,
        torch.__version__,
        version,
    )
    log.info("%s", table(rows))
    log.info("total wall time %.1f s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

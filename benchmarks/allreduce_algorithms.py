"""All-reduce algorithms measured against the alpha-beta prediction from the measured links.

    python benchmarks/allreduce_algorithms.py                        # 2 emulated nodes x 2 ranks
    python benchmarks/allreduce_algorithms.py --world 2 --nodes 0,0 --link ""   # calibration
    python benchmarks/allreduce_algorithms.py --sizes-mib 1,4,16,64

Every rank first runs ``shardwise.topology.discover`` (with the link emulator on when ``--link``
is given: messages between the emulated nodes wait alpha + bytes/bw), then times each algorithm
at each size (in turns): a barrier, the all_reduce, the slowest rank's time; the median over
``--iters``.
``predicted`` is ``shardwise.comm.schedules.predict_seconds`` from the measured links (the
backend's own ``native`` is priced as a ring; the emulator does not delay it). With
``--calibrate-mib S`` each algorithm's measured/predicted ratio at size S becomes its efficiency
factor and the other sizes are predicted with it (the error column then shows the model after
one calibration per algorithm). The summary compares hierarchical with the flat ring (measured
ratio against predicted ratio) and checks that ``auto`` is never more than 1.25x the best.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from provenance import source_version

from shardwise import comm
from shardwise.comm import emulate, schedules
from shardwise.testing import RankPool
from shardwise.topology import discover

ALGS = ["native", "ring", "halving_doubling", "tree", "hierarchical", "auto"]


def _once(t: torch.Tensor, alg: str, links: schedules.GroupLinks) -> float:
    """One all_reduce after a barrier; the slowest rank's seconds."""
    g = comm.world()
    comm.barrier(group=g)
    t0 = time.perf_counter()
    comm.all_reduce(t, "sum", g, algorithm=alg, links=links)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    comm.all_reduce(dt, "max", g)
    return float(dt.item())


def _task(nodes: str, link: str, sizes_mib: list[float], iters: int) -> list[dict]:
    os.environ[emulate.NODES_ENV] = nodes
    if link:
        os.environ[emulate.LINK_ENV] = link
    topo = discover(comm.world(), reps=10)
    links = topo.links()
    rows = []
    for mib in sizes_mib:
        t = torch.ones(int(mib * (1 << 20)) // 4)
        times: dict[str, list[float]] = {alg: [] for alg in ALGS}
        for it in range(iters + 1):  # algorithms take turns: background load hits all alike
            for alg in ALGS:
                seconds = _once(t, alg, links)
                if it:
                    times[alg].append(seconds)
        for alg in ALGS:
            chosen = schedules.choose(t.numel() * 4, 4, links) if alg == "auto" else alg
            # native (gloo's own, not emulated) is priced as a ring; calibration sets its factor
            model = "ring" if alg == "native" else chosen
            pred = schedules.predict_seconds(model, t.numel() * 4, 4, links)
            measured = statistics.median(times[alg])
            rows.append({"mib": mib, "alg": alg, "chosen": chosen, "s": measured, "pred": pred})
    rows.append({"min_r2": topo.min_r2(), "intra": links.intra, "inter": links.inter})
    return rows


def _report(rows: list[dict], calibrate: float | None) -> None:
    info, rows = rows[-1], rows[:-1]
    print(f"links: intra {info['intra']}, inter {info['inter']}, min R² {info['min_r2']:.3f}")
    factor = {}
    if calibrate is not None:
        factor = {r["alg"]: r["s"] / r["pred"] for r in rows if r["mib"] == calibrate}
    print(f"{'MiB':>6} {'algorithm':<18} {'chosen':<18} {'measured ms':>12} {'predicted ms':>13} "
          f"{'error':>7}")  # fmt: skip
    for r in rows:
        pred = r["pred"] * factor.get(r["alg"], 1.0)
        err = r["s"] / pred - 1
        print(f"{r['mib']:>6g} {r['alg']:<18} {r['chosen']:<18} {r['s'] * 1e3:>12.2f} "
              f"{pred * 1e3:>13.2f} {err:>+7.0%}")  # fmt: skip
    for mib in sorted({r["mib"] for r in rows}):
        by = {r["alg"]: r for r in rows if r["mib"] == mib}
        meas = by["ring"]["s"] / by["hierarchical"]["s"]
        pred = by["ring"]["pred"] / by["hierarchical"]["pred"]
        best = min(by[a]["s"] for a in ALGS if a not in ("auto", "native"))
        print(f"{mib:g} MiB: ring/hierarchical measured {meas:.2f}x, predicted {pred:.2f}x "
              f"({meas / pred - 1:+.0%}); auto ({by['auto']['chosen']}) / best = "
              f"{by['auto']['s'] / best:.2f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--nodes", default="0,0,1,1", help="node of each rank (emulated)")
    p.add_argument("--link", default="inter=alpha:1ms,bw:0.1GB/s", help="'' for none")
    p.add_argument("--sizes-mib", default="1,4,16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--calibrate-mib", type=float, default=None)
    args = p.parse_args()
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    print(f"# allreduce_algorithms @ {source_version()}: world {args.world}, nodes {args.nodes}, "
          f"link {args.link or 'none'}, iters {args.iters}")  # fmt: skip
    pool = RankPool(args.world)
    try:
        rows = pool.run(_task, args.nodes, args.link, sizes, args.iters, timeout_s=3600)[0]
    finally:
        pool.close()
    _report(rows, args.calibrate_mib)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

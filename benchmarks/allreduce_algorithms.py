"""All-reduce algorithms measured against the alpha-beta prediction from the measured links.

    python benchmarks/allreduce_algorithms.py                        # 2 emulated nodes x 2 ranks
    python benchmarks/allreduce_algorithms.py --world 2 --nodes 0,0 --link ""   # one node
    python benchmarks/allreduce_algorithms.py --sizes-mib 1,2,4,8,16,32 --calibrate-mib 1,16

Every rank first runs ``shardwise.topology.discover`` (with the link emulator on when ``--link``
is given: messages between the emulated nodes wait alpha + bytes/bw). Then each algorithm is
timed at each size, sizes and algorithms in turns (so background load hits all alike): a
barrier, 4 all_reduces back to back (as nccl-tests times a block), the slowest rank's time per
call. A size below ``--equal-time-mib`` is timed that many times more per turn (its spread is
wider). Each row is the median over the ``--iters`` turns, with the median's distribution-free
95% confidence interval; ``auto`` chooses with
the discovered links, as ``Config(allreduce_algorithm="auto")`` does. In the same turns the
comm layer's ring inside every node at once (the ranks sharing the cores as they do in the
algorithms) is timed: at the ``--calibrate-mib`` sizes it calibrates the model's link inside a
node (``costmodel.calibrate.fit_schedule_link``; between CPU processes the link is half-duplex,
``LinkCost.duplex``); the link across nodes stays the one discovery measured. ``predicted`` is
``shardwise.comm.allreduce_rounds.predict_seconds`` from those links; the backend's own ``native``
(which the emulator does not delay) is priced as a ring with the ring step fitted to its own
times at the calibration sizes (``fit_ring_step``). The rows fitted (those two at the
calibration sizes) are marked ``cal``; every other row tests the model. The summary compares
hierarchical with the flat ring (measured ratio against predicted ratio) and checks that
``auto`` is never more than 1.25x the best.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from provenance import source_version
from spread import median_interval

from shardwise import comm
from shardwise.comm import allreduce_rounds, emulate
from shardwise.costmodel import ring_seconds
from shardwise.costmodel.calibrate import fit_ring_step, fit_schedule_link, repeats_per_turn
from shardwise.testing import RankPool
from shardwise.topology import discover

ALGS = ["native", "ring", "halving_doubling", "tree", "hierarchical", "auto"]


BLOCK = 4  # back-to-back calls per timing, as nccl-tests times a block of iterations


def _once(
    t: torch.Tensor, alg: str, links: allreduce_rounds.GroupLinks, group: Any = None
) -> float:
    """``BLOCK`` all_reduces back to back after a barrier; the slowest rank's seconds per
    call (over the world)."""
    g = comm.world()
    comm.barrier(group=g)
    t0 = time.perf_counter()
    for _ in range(BLOCK):
        comm.all_reduce(t, "sum", group=group or g, algorithm=alg, links=links)
    dt = torch.tensor([(time.perf_counter() - t0) / BLOCK], dtype=torch.float64)
    comm.all_reduce(dt, "max", group=g)
    return float(dt.item())


def _tensor(mib: float) -> torch.Tensor:
    return torch.ones(int(mib * (1 << 20)) // 4)


INTRA = "ring inside the nodes"  # the calibration measurement, timed in turns with the others


def _task(nodes: str, link: str, sizes_mib: list[float], iters: int,
          equal_time_mib: float) -> dict:  # fmt: skip
    os.environ[emulate.NODES_ENV] = nodes
    if link:
        os.environ[emulate.LINK_ENV] = link
    topo = discover(comm.world(), reps=10)
    links = topo.links()  # what auto chooses with, as Config(allreduce_algorithm="auto") does
    me = comm.world().rank
    node_group = comm.split(links.nodes[me], me)
    assert node_group is not None
    members = tuple(r for r, n in enumerate(links.nodes) if n == links.nodes[me])
    node_links = topo.links(members)
    names = [*ALGS, INTRA]
    tensors = {mib: _tensor(mib) for mib in sizes_mib}
    times: dict[tuple[float, str], list[float]] = {(m, a): [] for m in sizes_mib for a in names}
    for it in range(iters + 1):  # sizes and algorithms take turns: background load hits all alike
        for mib, t in tensors.items():
            for _ in range(repeats_per_turn(mib, equal_time_mib)):
                for alg in names:
                    if alg == INTRA:
                        seconds = _once(t, "ring", node_links, node_group)
                    else:
                        seconds = _once(t, alg, links)
                    if it:
                        times[mib, alg].append(seconds)
    rows = []
    for (mib, alg), runs in times.items():
        t = tensors[mib]
        chosen = allreduce_rounds.choose(t.numel() * 4, 4, links) if alg == "auto" else alg
        lo, hi = median_interval(runs)
        rows.append({"mib": mib, "bytes": t.numel() * 4, "alg": alg, "chosen": chosen,
                     "s": statistics.median(runs), "lo": lo, "hi": hi, "n": len(runs)})  # fmt: skip
    return {"rows": rows, "min_r2": topo.min_r2(), "links": links, "world": comm.world().size,
            "node_size": len(members)}  # fmt: skip


def _predict(out: dict, calib: list[float]) -> allreduce_rounds.GroupLinks:
    """Set every row's prediction; return the links they come from: inside a node the link
    fitted to the ring inside the nodes at the calibration sizes (none: the discovered one)."""
    links, rows = out["links"], out["rows"]
    intra = [r for r in rows if r["alg"] == INTRA and r["mib"] in calib]
    if len(intra) >= 2 and out["node_size"] > 1:
        fitted = fit_schedule_link("ring", out["node_size"], [r["bytes"] for r in intra],
                                   [r["s"] for r in intra], links.intra.duplex)  # fmt: skip
        links = allreduce_rounds.GroupLinks(links.nodes, fitted, links.inter)
    native = [r for r in rows if r["alg"] == "native" and r["mib"] in calib]
    step = links.intra
    if len(native) >= 2:  # gloo's own all_reduce, priced as a ring of its fitted step
        step = fit_ring_step("all_reduce", out["world"], [r["bytes"] for r in native],
                             [r["s"] for r in native])  # fmt: skip
    for r in rows:
        if r["alg"] == "native":
            r["pred"] = ring_seconds(step, r["bytes"], out["world"])
        elif r["alg"] == INTRA:
            node = allreduce_rounds.GroupLinks((0,) * out["node_size"], links.intra, links.intra)
            r["pred"] = allreduce_rounds.predict_seconds("ring", r["bytes"], 4, node)
        else:
            r["pred"] = allreduce_rounds.predict_seconds(r["chosen"], r["bytes"], 4, links)
    return links


def _report(out: dict, calib: list[float]) -> None:
    rows = out["rows"]
    found = out["links"]
    links = _predict(out, calib)
    print(f"discovered: intra {found.intra}, inter {found.inter}, min R² {out['min_r2']:.3f}")
    print(f"model: intra {links.intra}, inter {links.inter}")
    print(f"{'MiB':>6} {'algorithm':<22} {'chosen':<17} {'n':>4} {'measured ms':>11} "
          f"{'95% CI of median':>17} {'predicted ms':>12} {'error':>6}")  # fmt: skip
    worst = 0.0
    for r in rows:
        err = r["s"] / r["pred"] - 1
        cal = r["mib"] in calib and r["alg"] in ("native", INTRA)  # the rows fitted
        if not cal:
            worst = max(worst, abs(err))
        ci = f"{r['lo'] * 1e3:.2f}-{r['hi'] * 1e3:.2f}"
        ms, pred = r["s"] * 1e3, r["pred"] * 1e3
        print(f"{r['mib']:>6g} {r['alg']:<22} {r['chosen']:<17} {r['n']:>4} {ms:>11.2f} "
              f"{ci:>17} {pred:>12.2f} {err:>+6.0%}{'  cal' if cal else ''}")  # fmt: skip
    print(f"largest |error| of the rows not fitted: {worst:.0%}")
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
    p.add_argument("--sizes-mib", default="1,2,4,8,16,32")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument(
        "--equal-time-mib",
        type=float,
        default=8.0,
        help="a size below this is timed about this/size times per turn (0: once)",
    )
    p.add_argument("--calibrate-mib", default="1,16", help="'' for the discovered link as is")
    args = p.parse_args()
    calib = [float(s) for s in args.calibrate_mib.split(",") if s]
    sizes = sorted({float(s) for s in args.sizes_mib.split(",")} | set(calib))
    print(f"# allreduce_algorithms @ {source_version()}: world {args.world}, nodes {args.nodes}, "
          f"link {args.link or 'none'}, iters {args.iters}, "
          f"equal-time {args.equal_time_mib:g} MiB")  # fmt: skip
    pool = RankPool(args.world)
    try:
        out = pool.run(
            _task, args.nodes, args.link, sizes, args.iters, args.equal_time_mib, timeout_s=3600
        )[0]
    finally:
        pool.close()
    _report(out, calib)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

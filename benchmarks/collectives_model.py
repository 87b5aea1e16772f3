"""The cost model's collectives against their measured times, at sizes the fit never saw.

    python benchmarks/collectives_model.py                  # 2 ranks, 1-64 MiB
    python benchmarks/collectives_model.py --world 3 --calibrate-mib 1,16

The cost model prices a tensor's all_reduce, all_gather and reduce_scatter inside a node as a
ring of fitted steps (``Hardware.collectives``, from ``costmodel.calibrate.fit_collectives``).
Here each collective (the comm layer's, on the backend's own algorithm) is timed over
``--sizes-mib`` by ``costmodel.calibrate.sample_collectives``: sizes and collectives take turns,
so background load hits all alike, and a size below ``--equal-time-mib`` is timed more often per
turn, since its times spread wider. Each time is the slowest rank's, after a barrier. Per
collective the ring step is fitted (``fit_ring_step``) to the medians at ``--calibrate-mib``
only (by default the sizes ``fit_collectives`` sweeps, so the fit is the one the step model
gets); every other size tests the prediction (``costmodel.predict.ring_seconds``), the same
function the step model uses. Each median comes with its distribution-free 95% interval.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from provenance import source_version
from spread import median_interval

from shardwise import comm
from shardwise.costmodel.calibrate import (
    COLLECTIVES,
    DEFAULT_SIZES,
    fit_ring_step,
    sample_collectives,
    timed_bytes,
)
from shardwise.costmodel.predict import ring_seconds
from shardwise.testing import RankPool

MIB = 1 << 20


def _task(sizes: list[int], iters: int, equal_time: int) -> dict:
    return sample_collectives(comm.world(), sizes, iters, COLLECTIVES, equal_time)


def _report(samples: dict, world: int, sizes: list[int], calib: list[int]) -> float:
    """Print the table; return the largest |error| of the rows not fitted."""
    print(f"{'op':<15} {'MiB':>5} {'n':>4} {'measured ms':>11} {'95% CI of median':>17} "
          f"{'predicted ms':>12} {'error':>6}  ring step fitted")  # fmt: skip
    worst = 0.0
    for op in COLLECTIVES:
        med = {s: statistics.median(samples[op, s]) for s in sizes}
        step = fit_ring_step(op, world, [timed_bytes(s, world) for s in calib],
                             [med[s] for s in calib])  # fmt: skip
        for s in sizes:
            pred = ring_seconds(step, timed_bytes(s, world), world, op)
            err = med[s] / pred - 1
            lo, hi = median_interval(samples[op, s])
            fitted = s in calib
            if not fitted:
                worst = max(worst, abs(err))
            ci = f"{lo * 1e3:.2f}-{hi * 1e3:.2f}"
            note = (f"  cal: {step.alpha_s * 1e6:.0f} us + {1e-9 / step.beta_s_per_byte:.2f} GB/s"
                    if fitted else "")  # fmt: skip
            print(f"{op:<15} {s / MIB:>5g} {len(samples[op, s]):>4} {med[s] * 1e3:>11.2f} "
                  f"{ci:>17} {pred * 1e3:>12.2f} {err:>+6.0%}{note}")  # fmt: skip
    print(f"largest |error| of the rows not fitted: {worst:.0%}")
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes-mib", default="1,2,4,8,16,32,64")
    p.add_argument("--calibrate-mib", default=",".join(f"{s // MIB}" for s in DEFAULT_SIZES))
    p.add_argument("--iters", type=int, default=15)
    more = "a size below this is timed about this/size times per turn (0: once)"
    p.add_argument("--equal-time-mib", type=float, default=32.0, help=more)
    args = p.parse_args()
    calib = [int(float(s) * MIB) for s in args.calibrate_mib.split(",") if s]
    if len(set(calib)) < 2:
        p.error("--calibrate-mib needs two or more sizes")
    sizes = sorted({int(float(s) * MIB) for s in args.sizes_mib.split(",")} | set(calib))
    print(f"# collectives_model @ {source_version()}: world {args.world}, iters {args.iters}, "
          f"equal-time {args.equal_time_mib:g} MiB, fit at {args.calibrate_mib} MiB")  # fmt: skip
    pool = RankPool(args.world)
    try:
        samples = pool.run(_task, sizes, args.iters, int(args.equal_time_mib * MIB),
                           timeout_s=3600)[0]  # fmt: skip
    finally:
        pool.close()
    _report(samples, args.world, sizes, calib)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

"""Pipelines whose stages sleep instead of computing, at 4 and 8 ranks: the measured step
against the simulator and the cost model's pipeline term.

    python benchmarks/pipeline_sleep.py [--ranks 4,8] [--microbatches 4,8]
        [--schedules gpipe,1f1b,interleaved_1f1b] [--t-fwd 0.05] [--t-bwd 0.1] [--json F]

Sleeping stages keep 4-8 processes from contending for this machine's 2 cores, so the step is
the schedule's own timing: m micro-batches of t_fwd + t_bwd per stage plus the bubble, plus
the messages (a few hundred microseconds each here). The simulator runs the schedule's actions
with those durations; the cost model predicts compute * (1 + bubble fraction) from its plan
(``Plan.bubble_fraction``). Each row is one step after a warm-up step, the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from provenance import source_version

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dist"))

COSTMODEL_SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved"}


def main() -> int:
    import pipeline_cases as pc

    from shardwise.costmodel import Plan
    from shardwise.parallel.pipeline import simulate
    from shardwise.testing import RankPool

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="4,8")
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    p.add_argument("--t-fwd", type=float, default=0.05)
    p.add_argument("--t-bwd", type=float, default=0.1)
    p.add_argument("--json")
    args = p.parse_args()
    t_f, t_b = args.t_fwd, args.t_bwd
    print(f"# pipeline_sleep @ {source_version()}: t_fwd {t_f} s, t_bwd {t_b} s per stage")
    print(f"{'schedule':<17} {'p':>2} {'m':>3} {'measured s':>10} {'simulated s':>11} "
          f"{'err':>6} {'cost model s':>12} {'err':>6}")  # fmt: skip
    rows = []
    for n in (int(r) for r in args.ranks.split(",")):
        pool = RankPool(n, pg_timeout_s=600.0, start_timeout_s=300.0)
        try:
            for schedule in args.schedules.split(","):
                v = 2 if schedule == "interleaved_1f1b" else 1
                for m in (int(x) for x in args.microbatches.split(",")):
                    if schedule == "interleaved_1f1b" and m % n:
                        continue  # interleaving needs m divisible by p
                    measured = max(pool.run(pc.task_sleep, schedule, m, v, t_f / v, t_b / v,
                                            timeout_s=600))  # fmt: skip
                    sim = simulate(schedule, n, m, virtual_stages=v, t_fwd=t_f / v,
                                   t_bwd=t_b / v, t_wgrad=0).makespan  # fmt: skip
                    plan = Plan(pp=n, micro_batches=m, schedule=COSTMODEL_SCHEDULE[schedule],
                                virtual_stages=v)  # fmt: skip
                    model = m * (t_f + t_b) * (1 + plan.bubble_fraction())
                    rows.append({"schedule": schedule, "p": n, "m": m, "measured_s": measured,
                                 "simulated_s": float(sim), "costmodel_s": model})  # fmt: skip
                    print(f"{schedule:<17} {n:>2} {m:>3} {measured:>10.3f} {float(sim):>11.3f} "
                          f"{measured / float(sim) - 1:>+6.0%} {model:>12.3f} "
                          f"{measured / model - 1:>+6.0%}")  # fmt: skip
        finally:
            pool.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"version": source_version(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

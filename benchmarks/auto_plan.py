"""Where ``--auto``'s choice lands among every layout that fits: for the built-in GPT at two sizes
and two global batches, the ranks are calibrated as ``shardwise train --auto`` calibrates them,
every fitting layout the train command can run is priced, and the layouts (all of them with
``--max-layouts 0``, or that many spread evenly over the predicted ranking, always with the
predicted best) run ``--steps`` steps each in ``--rounds`` interleaved turns (engines kept alive
between turns, so a drift in the machine's speed hits all alike); medians.

With ``--confirm K``, every layout is first screened: built, one warm-up step and
``--screen-steps`` timed steps, then freed (hundreds of engines do not fit at once). The K
fastest screened layouts and ``--auto``'s choice then take turns for ``--rounds`` rounds as
above; the choice's gap is measured against the fastest of those, and the rank correlation is
over every screened layout. ``--screened F`` takes the screened steps from an earlier run's
``--json`` instead (for longer rounds without screening again); ``--auto``'s choice comes from
this run's calibration. The rank processes are replaced every ``_RENEW_EVERY`` screened
layouts, so what one layout leaves behind in a process (allocator growth, caches) cannot starve
the later ones.

    python benchmarks/auto_plan.py [--models tiny,small] [--batches 8,16] [--ranks 2,4]
        [--max-layouts 10] [--confirm 0] [--screen-steps 2] [--steps 3] [--rounds 3]
        [--budget-s 20] [--json F] [--screened F]

Per configuration: each layout's measured step, predicted step and both ranks, ``*`` on
``--auto``'s choice (the predicted best), its gap to the fastest measured layout, and the rank
correlation (Spearman) of predicted and measured step times. Rows at 4 ranks are for
information (more ranks than cores here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

from provenance import source_version

_TRIALS: dict[str, Any] = {}  # per worker process: the engine of each layout, built once
_RENEW_EVERY = 40  # screened layouts per pool of rank processes


class _Pool:
    """A ``RankPool`` that can be replaced by fresh rank processes between screened layouts."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool = self._start()

    def _start(self) -> Any:
        from shardwise.testing import RankPool

        # the layouts' engines live on between turns, and so must their groups
        return RankPool(self.n, pg_timeout_s=900.0, start_timeout_s=300.0, keep_groups=True)

    def run(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self.pool.run(*args, **kwargs)

    def renew(self) -> None:
        self.pool.close()
        self.pool = self._start()

    def close(self) -> None:
        self.pool.close()


def calibrate_rank(model: str, budget_s: float) -> dict:
    import torch

    import shardwise
    from shardwise import comm
    from shardwise.comm import current_world
    from shardwise.costmodel.calibrate_ranks import ComputeProbe, calibrate_ranks
    from shardwise.costmodel.shapes import gpt_shape
    from shardwise.train.trial import Trial

    torch.set_num_threads(1)
    world = current_world.current()
    n = shardwise.world_size()
    alone = comm.split(world.rank, 0)
    one, split = (_run(model, n, b, accum) for b, accum in ((4, 1), (1, 4)))
    probe = ComputeProbe(Trial(one, world, alone).step, 4, "fp32",
                         Trial(split, world, alone).step)  # fmt: skip
    shape = gpt_shape(model, one.model)
    return calibrate_ranks(world.group, shape, probe, budget_s, n, 4 << 30).to_dict()


def _run(model: str, n: int, micro: int, accum: int) -> Any:
    from shardwise.config import Config
    from shardwise.train.options import RunConfig, TrainOptions

    engine = Config(micro_batch_size=micro, gradient_accumulation_steps=accum)
    return RunConfig(train=TrainOptions(model=model), engine=engine, world_size=n,
                     launch={"nproc_per_node": n})  # fmt: skip


def time_rank(key: str, run_dict: dict, steps: int, warmup: int, keep: bool = True) -> list[float]:
    import gc

    import torch

    from shardwise.comm import current_world
    from shardwise.train.options import RunConfig
    from shardwise.train.trial import Trial

    torch.set_num_threads(1)
    if key not in _TRIALS:
        _TRIALS[key] = Trial(RunConfig.from_dict(run_dict), current_world.current())
    times = _TRIALS[key].timed(steps, warmup)
    if not keep:  # a screened layout: free its engine before the next one is built
        del _TRIALS[key]
        gc.collect()
    return times


def _screen(
    pool: Any, name: str, picks: list, runs: list[dict], args: Any
) -> tuple[list[int], list[float]]:
    """Every layout once (built, timed, freed): the indices of the ``--confirm`` fastest and of
    the predicted best (index 0), and each layout's screened median in ``picks``' order."""
    screened = []
    for i, run in enumerate(runs):
        if i and i % _RENEW_EVERY == 0:
            pool.renew()
        key = f"{name}/{picks[i].layout.describe()}/screen"
        print(f"  screening {i + 1}/{len(runs)}: {key}", file=sys.stderr, flush=True)
        t = pool.run(time_rank, key, run, args.screen_steps, 1, False, timeout_s=900)[0]
        screened.append(statistics.median(t))
    order = sorted(range(len(runs)), key=lambda i: screened[i])
    keep = sorted({0, *order[: args.confirm]})
    return keep, screened


def _earlier_screen(path: str | None, model: str, n: int, batch: int) -> dict[str, float] | None:
    """Each layout's screened step from an earlier run's ``--json`` (``--screened``), or None."""
    if path is None:
        return None
    with open(path) as f:
        for c in json.load(f)["configs"]:
            if (c["model"], c["ranks"], c["global_batch"]) == (model, n, batch):
                return {r["layout"]: r["screened_s"] for r in c["rows"] if r["screened_s"]}
    return None


def _config(pool: Any, model: str, n: int, batch: int, args: Any) -> dict:
    from shardwise.cli.train_auto import CHECKS
    from shardwise.costmodel.calibrate_ranks import Calibration
    from shardwise.costmodel.rank_correlation import rank_correlation
    from shardwise.train import layout_choice

    calib = Calibration.from_dict(pool.run(calibrate_rank, model, args.budget_s, timeout_s=900)[0])
    base = _run(model, n, 8, 1)
    ranked = layout_choice.choose(base, calib.hardware, batch, {}, CHECKS).result.ranked
    picks = ranked
    if args.max_layouts and len(ranked) > args.max_layouts:
        step = (len(ranked) - 1) / (args.max_layouts - 1)
        picks = [ranked[round(i * step)] for i in range(args.max_layouts)]
    runs = [layout_choice.run_config(base, r.layout).to_dict() for r in picks]
    screened: list[float] | None = None
    chosen = list(range(len(picks)))
    earlier = _earlier_screen(args.screened, model, n, batch)
    if args.confirm and earlier is not None:
        screened = [earlier.get(r.layout.describe(), math.inf) for r in picks]
        order = sorted(range(len(picks)), key=lambda i: screened[i])
        chosen = sorted({0, *order[: args.confirm]})
    elif args.confirm:
        chosen, screened = _screen(pool, f"{model}/{batch}", picks, runs, args)
    times: list[list[float]] = [[] for _ in picks]
    for rnd in range(args.rounds):
        for i in chosen:
            key = f"{model}/{batch}/{picks[i].layout.describe()}"
            warm = 1 if rnd == 0 else 0
            times[i] += pool.run(time_rank, key, runs[i], args.steps, warm, timeout_s=900)[0]
    for key in [k for k in _TRIALS if k.startswith(f"{model}/{batch}/")]:
        del _TRIALS[key]  # only the lead's copy; the ranks' engines live in the pool
    measured = [statistics.median(t) if t else None for t in times]
    predicted = [r.prediction.step_s for r in picks]
    fastest = min(m for m in measured if m is not None)
    rows = [{"layout": r.layout.describe(), "predicted_s": p, "measured_s": m,
             "screened_s": None if screened is None else screened[i],
             "predicted_rank": ranked.index(r) + 1, "auto": i == 0}
            for i, (r, p, m) in enumerate(zip(picks, predicted, measured))]  # fmt: skip
    basis = measured if screened is None else screened  # every layout has a time here
    by_meas = sorted(range(len(rows)), key=lambda i: basis[i])
    for pos, i in enumerate(by_meas, 1):
        rows[i]["measured_rank"] = pos
    rho = rank_correlation(predicted, basis) if len(rows) > 1 else None
    return {"model": model, "ranks": n, "global_batch": batch, "fitting": len(ranked),
            "calibration": calib.describe(), "rows": rows, "confirmed": len(chosen),
            "auto_vs_fastest": measured[0] / fastest - 1, "spearman": rho}  # fmt: skip


def _print(c: dict) -> None:
    print(f"\n## {c['model']}, {c['ranks']} ranks, global batch {c['global_batch']}: "
          f"{c['fitting']} layouts fit, {len(c['rows'])} run, "
          f"{c['confirmed']} in the rounds")  # fmt: skip
    print(f"   {c['calibration']}")
    print(f"{'':1} {'layout':<66} {'pred s':>8} {'pred#':>5} {'screen s':>8} {'rounds s':>8} "
          f"{'meas#':>5}")  # fmt: skip
    for r in sorted(c["rows"], key=lambda r: r["measured_rank"]):
        mark = "*" if r["auto"] else " "
        scr = "" if r["screened_s"] is None else f"{r['screened_s']:.4f}"
        mea = "" if r["measured_s"] is None else f"{r['measured_s']:.4f}"
        print(f"{mark} {r['layout']:<66} {r['predicted_s']:>8.4f} {r['predicted_rank']:>5} "
              f"{scr:>8} {mea:>8} {r['measured_rank']:>5}")  # fmt: skip
    rho = "n/a" if c["spearman"] is None else f"{c['spearman']:+.2f}"
    over = "in the rounds" if c["confirmed"] < len(c["rows"]) else "measured"
    print(f"--auto's choice (*): {c['auto_vs_fastest']:+.1%} vs the fastest {over}; "
          f"Spearman {rho} over {len(c['rows'])} layouts")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--batches", default="8,16")
    p.add_argument("--ranks", default="2")
    p.add_argument("--max-layouts", type=int, default=10)
    p.add_argument("--confirm", type=int, default=0, help="screen all, then K in the rounds")
    p.add_argument("--screen-steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=20.0)
    p.add_argument("--json")
    p.add_argument("--screened", help="take each layout's screened step from this earlier --json")
    args = p.parse_args()
    print(f"# auto_plan @ {source_version()}: {os.cpu_count()} cores, {vars(args)}")
    configs = []
    for n in (int(r) for r in args.ranks.split(",")):
        pool = _Pool(n)
        try:
            for model in args.models.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    configs.append(_config(pool, model, n, batch, args))
                    _print(configs[-1])
        finally:
            pool.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": source_version(), "args": vars(args), "configs": configs}, f,
                      indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

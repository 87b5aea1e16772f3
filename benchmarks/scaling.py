"""Weak scaling of the built-in GPT over 1..N ranks for data parallel, ZeRO-3, tensor parallel
and pipeline parallel, each measurement beside the cost model's prediction.

    python benchmarks/scaling.py [--model anchor] [--ranks 1,2,4] [--systems dp,zero3,tp,pp]
        [--micro-batch 2] [--steps 2] [--rounds 3] [--warmup 1] [--sync-segments-ms 20,50,100]
        [--json out.json] [--png out.png]

Weak scaling: every rank brings ``--micro-batch`` sequences, so the global batch at N ranks is
N times the one-rank batch. dp and ZeRO-3 give each rank its own sequences; tp (tp=N) runs the
whole global batch on every rank with each layer split N ways; pp (pp=N, 1F1B) runs it as
N * micro-batch micro-batches of one sequence. Scaling efficiency = tokens/s at N ranks over N
times tokens/s at one rank (the one-process step of the same per-rank batch).

Every run keeps its processes and engine while the runs take turns (``--rounds`` turns of
``--steps`` timed steps each), so a drift in the machine's speed hits all alike.

Per row: median step (the slowest rank's), tokens/s, efficiency, exposed communication as a share
of the step (``exposed_comm_seconds``: time ranks were blocked on collectives or messages),
bytes per step, and the cost model's step time and efficiency for the same plan. The cost model
is calibrated on this machine, never on the runs it predicts: compute FLOP/s from the one-rank
step, and at each N from N copies of that step run at once, each alone (no communication), so
the cores are as busy as in the runs (SMT siblings, shared memory bandwidth and more ranks than
cores slow a rank's compute, and the model's per-device FLOP/s must say so); memory bandwidth
from a copy; and at each N the point-to-point link from
``topology.discover`` and each collective's ring step from a timed sweep of 1-64 MiB
(``costmodel.calibrate.fit_collectives``); communication does not overlap compute (gloo reduces
on the cores the step computes on: ``Hardware.overlap=False``); and the share of compute lost
where ranks meet often (tp collectives, pp messages) from a matmul-then-all_reduce loop
(``costmodel.calibrate.measure_sync_loss``). The pipeline plan carries the
partition's layers per stage. An all-reduce bus
bandwidth (nccl-tests' definition: 2(N-1)/N * bytes / time) of a gradient-sized buffer is
measured at each N.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from provenance import source_version

SYSTEMS = ("dp", "zero3", "tp", "pp")
OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _build(system: str, model_name: str, n: int, micro: int) -> tuple[Any, int]:
    """(engine, sequences this rank feeds per step as a multiple of the micro-batch)."""
    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.pipeline import PipelineModule
    from shardwise.parallel.plans.gpt import pipeline_layers, tp_plan
    from shardwise.parallel.tensor import parallelize

    cfg = GPTConfig.named(model_name)
    torch.manual_seed(0)
    model = GPT(cfg)
    if system == "alone":  # every rank trains its own one-rank copy: compute at full occupancy
        from shardwise import comm

        alone = comm.split(comm.world().rank, 0)
        opt = torch.optim.AdamW(model.parameters(), **OPTIM)
        return shardwise.initialize(model, opt, shardwise.Config(), group=alone), 1
    if system in ("dp", "zero3") or n == 1:
        opt = torch.optim.AdamW(model.parameters(), **OPTIM)
        zero = 3 if system == "zero3" else 0
        return shardwise.initialize(model, opt, shardwise.Config(zero_stage=zero)), 1
    if system == "tp":
        mesh = shardwise.Mesh(dp=1, tp=n)
        where = parallelize(model, mesh, tp_plan()).placements
        opt = torch.optim.AdamW(model.parameters(), **OPTIM)
        cfg = shardwise.Config()
        return shardwise.initialize(model, opt, cfg, group=mesh, placements=where), n
    mesh = shardwise.Mesh(dp=1, pp=n)
    pipe = PipelineModule(pipeline_layers(model), _gpt_loss, mesh, "parameters")
    opt = torch.optim.AdamW(pipe.parameters(), **OPTIM)
    # one sequence per micro-batch: n * micro of them
    config = shardwise.Config(pipeline_schedule="1f1b", pipeline_microbatches=n * micro)
    return shardwise.initialize(pipe, opt, config, group=mesh), n


_ENGINES: dict[tuple, tuple[Any, int, Any]] = {}  # per worker process: built once, timed in turns


def run_rank(system: str, model_name: str, micro: int, steps: int, warmup: int) -> dict:
    import shardwise
    from shardwise import comm
    from shardwise.comm import current_world
    from shardwise.models.gpt import GPTConfig

    torch.set_num_threads(1)
    n = shardwise.world_size()
    cfg = GPTConfig.named(model_name)
    key = (system, model_name, n, micro)
    if key not in _ENGINES:  # the world it was built in counts its traffic in later turns too
        _ENGINES[key] = (*_build(system, model_name, n, micro), current_world.current())
    engine, share, home = _ENGINES[key]
    seqs = micro * share
    gen = torch.Generator().manual_seed(1 + shardwise.rank() * (share == 1))
    world = home.group
    times, exposed, sent = [], [], {}
    for i in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (seqs, cfg.seq_len + 1), generator=gen)
        comm.barrier(group=world)
        home.stats.snapshot(True)
        home.stats.exposed(True)
        t0 = time.perf_counter()
        if system == "pp" and n > 1:
            engine.train_batch(x[:, :-1], x[:, 1:])
        else:
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
        dt = time.perf_counter() - t0
        blocked = home.stats.exposed(True)
        stats = home.stats.snapshot(True)
        slowest = torch.tensor([dt], dtype=torch.float64)
        comm.all_reduce(slowest, "max", group=world)
        if i >= warmup:
            times.append(float(slowest.item()))
            exposed.append(blocked / dt)
            sent = {op: int(s["bytes"]) for op, s in stats.items()}
    return {"times": times, "exposed": exposed, "bytes": sent, "tokens": seqs * cfg.seq_len}


def busbw_rank(numel: int, iters: int) -> float:
    """nccl-tests bus bandwidth (GB/s) of an fp32 all_reduce of ``numel`` elements."""
    import shardwise
    from shardwise import comm

    torch.set_num_threads(1)
    n, world = shardwise.world_size(), comm.world()
    buf = torch.ones(numel)
    comm.all_reduce(buf, "sum", group=world)
    times = []
    for _ in range(iters):
        comm.barrier(group=world)
        t0 = time.perf_counter()
        comm.all_reduce(buf, "sum", group=world)
        times.append(time.perf_counter() - t0)
    return 2 * (n - 1) / n * numel * 4 / statistics.median(times) / 1e9


def links_rank(sync_segments_s: tuple[float, ...]) -> tuple:
    """(intra, inter, memory bandwidth, per-collective ring steps, sync loss) measured over the
    world."""
    from shardwise import comm
    from shardwise.costmodel.calibrate import fit_collectives, measure_sync_loss
    from shardwise.costmodel.hardware import measure_memory_bandwidth
    from shardwise.topology import discover

    torch.set_num_threads(1)
    links = discover(comm.world(), reps=10).links()
    collectives = fit_collectives(comm.world())
    sync = measure_sync_loss(comm.world(), sync_segments_s)
    return links.intra, links.inter, measure_memory_bandwidth(), collectives, sync


def _stage_layers(model_name: str, n: int) -> tuple[int, ...]:
    """Transformer blocks per stage of the pipeline ``_build`` forms (its default partition)."""
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.pipeline.partition import partition_layers
    from shardwise.parallel.pipeline.stage import layer_parameter_counts
    from shardwise.parallel.plans.gpt import pipeline_layers

    entries = pipeline_layers(GPT(GPTConfig.named(model_name)))
    bounds = partition_layers(layer_parameter_counts(entries), n, "parameters")
    blocks = [i for i, e in enumerate(entries) if type(e).__name__ == "Block"]
    return tuple(sum(lo <= i < hi for i in blocks) for lo, hi in itertools.pairwise(bounds))


def _plan(system: str, n: int, micro: int, model_name: str) -> Any:
    from shardwise.costmodel import Plan

    if system == "dp" or n == 1:
        return Plan(dp=n, micro_batch=micro, precision="fp32")
    if system == "zero3":
        return Plan(dp=n, micro_batch=micro, zero_stage=3, precision="fp32")
    if system == "tp":
        return Plan(tp=n, micro_batch=n * micro, precision="fp32")
    return Plan(pp=n, micro_batch=1, micro_batches=n * micro, schedule="1f1b", precision="fp32",
                stage_layers=_stage_layers(model_name, n))  # fmt: skip


def _pool(n: int, fn: Any, *args: Any) -> list:
    from shardwise.testing import RankPool

    pool = RankPool(n, pg_timeout_s=900.0, start_timeout_s=300.0)
    try:
        return pool.run(fn, *args, timeout_s=3600)
    finally:
        pool.close()


def _timed_in_turns(ranks: list[int], systems: list[str], args: Any) -> dict:
    """Per (ranks, system): the one-rank step, then at each N the N one-rank steps at once
    ("alone") and every system, run ``--rounds`` times in turns (each pool keeps its engine),
    so a drift in the machine's speed hits calibration and measurement alike."""
    from shardwise.testing import RankPool

    runs: dict[tuple[int, str], dict] = {}
    for n in [r for r in ranks if r > 1] or [1]:
        jobs = [(1, "dp")] + [(n, s) for s in ("alone", *systems) if n > 1]
        pools = {job: RankPool(job[0], pg_timeout_s=900.0, start_timeout_s=300.0,
                               keep_groups=True) for job in jobs}  # fmt: skip
        try:
            for rnd in range(args.rounds):
                for job, pool in pools.items():
                    warm = args.warmup if rnd == 0 else 0  # a new pool's first turn
                    r = pool.run(run_rank, job[1], args.model, args.micro_batch, args.steps, warm,
                                 timeout_s=3600)[0]  # fmt: skip
                    if job in runs:
                        runs[job]["times"] += r["times"]
                        runs[job]["exposed"] += r["exposed"]
                    else:
                        runs[job] = r
        finally:
            for pool in pools.values():
                pool.close()
    return runs


def _png(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in SYSTEMS:
        got = [r for r in rows if r["system"] == system]
        if not got:
            continue
        ns = [r["ranks"] for r in got]
        line = ax.plot(ns, [r["efficiency"] for r in got], marker="o", label=f"{system} measured")
        color = line[0].get_color()
        ax.plot(ns, [r["predicted_efficiency"] for r in got], ls="--", color=color, alpha=0.7)
    ax.set_xlabel("ranks")
    ax.set_ylabel("weak-scaling efficiency (dashed: cost model)")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    import shardwise
    from shardwise.costmodel import predict, shape
    from shardwise.models.gpt import GPTConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="anchor")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=2, help="timed steps per turn")
    p.add_argument("--rounds", type=int, default=3, help="turns of every run")
    sync_help = "compute segments the sync loss is measured at (measure_sync_loss)"
    p.add_argument("--sync-segments-ms", default="20,50,100", help=sync_help)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or 1 not in ranks:
        p.error(f"--systems from {SYSTEMS} (got {sorted(unknown)}); --ranks must include 1")
    m, micro = shape(args.model), args.micro_batch
    print(f"# scaling @ {source_version()}: {args.model}, {micro} sequences per rank, "
          f"{os.cpu_count()} cores, ranks {ranks}")  # fmt: skip
    runs = _timed_in_turns(ranks, systems, args)
    one = runs[1, "dp"]
    t1 = statistics.median(one["times"])
    busy = {n: statistics.median(runs[n, "alone"]["times"]) for n in ranks if n > 1}
    segments = tuple(float(ms) / 1e3 for ms in args.sync_segments_ms.split(","))
    calib = {n: _pool(n, links_rank, segments)[0] for n in ranks if n > 1}
    intra, inter, membw, _, _ = calib[min(calib)]
    base = predict(m, _plan("dp", 1, micro, args.model), shardwise.costmodel.measured(
        (intra, inter), 64, 1.0, 1 << 40, membw))  # fmt: skip

    def flops_at(step_s: float) -> float:
        return base.breakdown["compute"] / (step_s - base.breakdown["optimizer"])

    flops = {1: flops_at(t1)} | {n: flops_at(t) for n, t in busy.items()}
    print(f"calibration: 1 rank {t1:.3f} s/step -> {flops[1] / 1e9:.2f} GFLOP/s per rank; "
          f"memory {membw / 1e9:.1f} GB/s")  # fmt: skip
    for n, (a, _, _, fits, sync) in calib.items():
        rings = ", ".join(f"{op} {c.alpha_s * 1e6:.0f} us + {1 / c.beta_s_per_byte / 1e9:.2f} GB/s"
                          for op, c in fits.items())  # fmt: skip
        print(f"  {n} ranks: {n} one-rank steps at once {busy[n]:.3f} s/step -> "
              f"{flops[n] / 1e9:.2f} GFLOP/s per rank; p2p alpha {a.alpha_s * 1e6:.0f} us, "
              f"{1 / a.beta_s_per_byte / 1e9:.2f} GB/s; ring steps: {rings}; "
              f"sync loss {sync:.1%}")  # fmt: skip
    tok1 = one["tokens"] / t1

    def hw_at(n: int) -> Any:
        if n == 1:
            return shardwise.costmodel.measured((intra, inter), 64, flops[1], 1 << 40, membw)
        a, b, bw, fits, sync = calib[n]
        return shardwise.costmodel.measured(
            (a, b), 64, flops[n], 1 << 40, bw, collectives=fits, overlap=False, sync_loss=sync
        )

    rows: list[dict] = []
    busbw: dict[int, float] = {}
    grad_numel = GPTConfig.named(args.model).param_count()
    pred1 = predict(m, _plan("dp", 1, micro, args.model), hw_at(1)).step_s  # = t1
    for n in ranks:
        if n > 1:
            busbw[n] = statistics.median(_pool(n, busbw_rank, grad_numel, 5))
        hw = hw_at(n)
        for system in systems:
            r = one if n == 1 else runs[n, system]
            step = statistics.median(r["times"])
            tokens = r["tokens"] * (n if system in ("dp", "zero3") else 1)
            pred = predict(m, _plan(system, n, micro, args.model), hw)
            rows.append({
                "system": system, "ranks": n, "step_s": step, "tokens_per_s": tokens / step,
                "efficiency": tokens / step / (n * tok1),
                "exposed_comm_share": statistics.median(r["exposed"]) if r["exposed"] else 0.0,
                "bytes_per_step": r["bytes"], "predicted_step_s": pred.step_s,
                "predicted_breakdown": pred.breakdown,
                "predicted_efficiency": tokens / pred.step_s / (n * one["tokens"] / pred1),
                "calibration_gflops": flops[n] / 1e9,
            })  # fmt: skip
    head = (f"{'system':<6} {'ranks':>5} {'step s':>8} {'tok/s':>8} {'eff':>6} "
            f"{'exposed':>8} {'pred s':>8} {'pred eff':>8} {'err':>6}")  # fmt: skip
    print(head)
    for r in rows:
        err = r["step_s"] / r["predicted_step_s"] - 1
        print(
            f"{r['system']:<6} {r['ranks']:>5} {r['step_s']:>8.3f} {r['tokens_per_s']:>8.0f} "
            f"{r['efficiency']:>6.2f} {r['exposed_comm_share']:>8.0%} "
            f"{r['predicted_step_s']:>8.3f} {r['predicted_efficiency']:>8.2f} {err:>+6.0%}"
        )
    for n, bw in busbw.items():
        print(f"all_reduce busbw at {n} ranks ({grad_numel * 4 / 2**20:.0f} MiB fp32): "
              f"{bw:.2f} GB/s")  # fmt: skip
    out = {"version": source_version(), "args": vars(args), "calibration_gflops": flops[1] / 1e9,
           "rows": rows, "allreduce_busbw_gbs": busbw}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.png:
        _png(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

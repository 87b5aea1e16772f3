"""Pipeline schedules at pp=2 (GPipe, 1F1B, interleaved 1F1B, ZB-H1; m micro-batches) against
data parallelism (dp=2, shardwise ZeRO-0) on the same global batch.

    python benchmarks/pipeline_schedules.py [--model anchor] [--steps 4] [--warmup 1]
        [--seqs 8] [--microbatches 2,4,8] [--schedules gpipe,1f1b,interleaved_1f1b,zb_h1]
        [--no-dp] [--json out.json]

The problem is the anchor one (shared/ANCHORS.md): GPT "anchor", 8 sequences per step in all,
AdamW(lr 1e-3, betas (0.9, 0.95), weight decay 0.1), fp32, gloo, one thread per rank. The GPT
is split with ``pipeline_layers(GPT)`` (token embedding and head tied across the two stages),
partitioned by parameter count (by layer count for interleaved, which needs 4 chunks).

Per system: the slowest rank's median step time; the measured bubble (idle over compute time
on each rank, from the executor's per-action timings) next to the simulator's bubble for the
same schedule fed with the measured mean forward / backward / weight-gradient times per stage
(so the difference is what the model leaves out: messages, Python, contention); peak RSS per
rank; send/recv bytes per step. Each system runs in fresh rank processes (its own peak RSS).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from provenance import source_version
from tp_vs_dp import OPTIM, MiB
from tp_vs_dp import _batches as batches

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.plans.gpt import pipeline_layers


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _mean_times(slots: list[tuple[Any, float, float]]) -> dict[str, float]:
    """Mean seconds per F / B / I / W action on this rank."""
    by_kind: dict[str, list[float]] = {}
    for action, start, end in slots:
        by_kind.setdefault(action.kind.value, []).append(end - start)
    return {k: statistics.fmean(v) for k, v in by_kind.items()}


def run_pipeline_rank(
    schedule: str, m: int, model: str, seqs: int, steps: int, warmup: int
) -> dict:
    import shardwise
    from shardwise import comm
    from shardwise.parallel.pipeline import PipelineExecutor, PipelineModule

    cfg = GPTConfig.named(model)
    torch.manual_seed(0)
    v = 2 if schedule == "interleaved_1f1b" else 1
    mesh = shardwise.Mesh(pp=2, dp=1)
    partition = "uniform" if v > 1 else "parameters"
    pipe = PipelineModule(pipeline_layers(GPT(cfg)), gpt_loss, mesh, partition, virtual_stages=v)
    run = PipelineExecutor(pipe, schedule, microbatches=m)
    opt = torch.optim.AdamW(pipe.parameters(), **OPTIM)
    world = comm.world()
    times, losses, bubbles, kinds, sent = [], [], [], [], []
    for i, (x, y) in enumerate(batches(cfg, seqs, warmup + steps)):
        comm.barrier(group=world)
        comm.comm_stats(reset=True)
        t0 = time.perf_counter()
        loss = run.train_batch(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        stats = comm.comm_stats(reset=True)
        losses.append(loss.item())
        if i >= warmup:
            times.append(dt)
            bubbles.append(run.last_step.bubble)
            kinds.append(_mean_times(run.last_step.slots))
            sent.append({op: stats.get(op, {}).get("bytes", 0) for op in ("send", "recv")})
    mean = {k: statistics.fmean(d[k] for d in kinds) for k in kinds[0]} if kinds else {}
    return {
        "times": times,
        "losses": losses,
        "bubble": statistics.fmean(bubbles) if bubbles else None,
        "action_s": mean,
        "bytes": sent[-1] if sent else {},
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_dp_rank(model: str, seqs: int, steps: int, warmup: int) -> dict:
    import shardwise
    from shardwise import comm

    cfg = GPTConfig.named(model)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    opt = torch.optim.AdamW(gpt.parameters(), **OPTIM)
    engine = shardwise.initialize(gpt, opt, shardwise.Config(zero_stage=0))
    world = comm.world()
    times, losses = [], []
    for i, (x, y) in enumerate(batches(cfg, seqs, warmup + steps)):
        x, y = x.chunk(2)[shardwise.rank()], y.chunk(2)[shardwise.rank()]
        comm.barrier(group=world)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(dt)
    return {
        "times": times,
        "losses": losses,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _simulated_bubble(schedule: str, m: int, results: list[dict]) -> float:
    """The simulator's bubble for this schedule with the measured per-stage action times (the
    slower rank's means: the simulator takes one time per action kind)."""
    from shardwise.parallel.pipeline import simulate

    def t(kind: str) -> float:
        return max(r["action_s"].get(kind, 0.0) for r in results)

    v = 2 if schedule == "interleaved_1f1b" else 1
    if schedule == "zb_h1":
        t_b, t_w = t("I"), t("W")
    else:
        t_b, t_w = t("B"), 0.0
    res = simulate(schedule, 2, m, virtual_stages=v, t_fwd=t("F"), t_bwd=t_b, t_wgrad=t_w)
    return float(res.bubble)


def _pool_run(fn: Any, *args: Any) -> list[dict]:
    from shardwise.testing import RankPool

    pool = RankPool(2, pg_timeout_s=600.0, start_timeout_s=300.0)
    try:
        return pool.run(fn, *args, timeout_s=3600)
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="anchor")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per step, all ranks together")
    ap.add_argument("--microbatches", default="2,4,8")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zb_h1")
    ap.add_argument("--no-dp", action="store_true", help="skip the dp=2 baseline")
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = GPTConfig.named(args.model)
    rows = []
    if not args.no_dp:
        res = _pool_run(run_dp_rank, args.model, args.seqs, args.steps, args.warmup)
        step = statistics.median(max(s) for s in zip(*(r["times"] for r in res)))
        rows.append({"system": "dp2", "step_s": step, "maxrss_mib": [r["maxrss_mib"] for r in res]})
    for schedule in args.schedules.split(","):
        for m in (int(s) for s in args.microbatches.split(",")):
            res = _pool_run(
                run_pipeline_rank, schedule, m, args.model, args.seqs, args.steps, args.warmup
            )
            step = statistics.median(max(s) for s in zip(*(r["times"] for r in res)))
            rows.append(
                {
                    "system": f"pp2 {schedule} m={m}",
                    "step_s": step,
                    "bubble_measured": [r["bubble"] for r in res],
                    "bubble_simulated": _simulated_bubble(schedule, m, res),
                    "bytes": [r["bytes"] for r in res],
                    "maxrss_mib": [r["maxrss_mib"] for r in res],
                    "final_loss": res[-1]["losses"][-1],
                }
            )
    print(f"# {args.model}, {args.seqs} x {cfg.seq_len} tokens per step, code {source_version()}")
    for r in rows:
        rss = ", ".join(f"{x:.0f}" for x in r["maxrss_mib"])
        line = f"{r['system']:>26}: step {r['step_s']:.3f} s, peak RSS {rss} MiB"
        if "bytes" in r:
            sent = ", ".join(f"{b['send'] / MiB:.2f}/{b['recv'] / MiB:.2f}" for b in r["bytes"])
            measured = ", ".join(f"{b:.3f}" for b in r["bubble_measured"])
            line += (
                f", bubble measured per rank {measured} vs simulated {r['bubble_simulated']:.3f}"
                f", send/recv MiB per rank {sent}, final loss {r['final_loss']:.4f}"
            )
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": source_version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

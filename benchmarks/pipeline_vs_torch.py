"""shardwise's pipeline executor against torch.distributed.pipelining at pp=2 (1F1B and GPipe)
on the same split of the same GPT, the same batches and the same optimizer.

    python benchmarks/pipeline_vs_torch.py [--model anchor] [--microbatches 4] [--steps 4]
        [--warmup 1] [--rounds 3] [--seqs 8] [--systems sw_1f1b,torch_1f1b,sw_gpipe,torch_gpipe]
        [--profile] [--json out.json]

(``sw_1f1b_noahead`` / ``sw_gpipe_noahead``: the executor with its receives posted by their
actions rather than ahead, for an A/B of that change in the same run.)

The problem is the anchor one (shared/ANCHORS.md): GPT "anchor", 8 sequences of 256 tokens per
step, AdamW(lr 1e-3, betas (0.9, 0.95), weight decay 0.1), fp32, gloo, one thread per rank.
Both sides run the stages of one ``PipelineModule(pipeline_layers(GPT))`` split by parameter
count (token embedding + positions + 3 blocks | 3 blocks + final norm + tied head): torch's
``PipelineStage`` wraps the rank's stage (``forward_stage``), with static shapes, so both run
the same modules. The tied embedding / head gradients are summed over the two ranks after the
schedule on both sides (``reduce_tied_grads``: one 16 MiB all_reduce). Each micro-batch's loss
is its mean over m (torch: ``scale_grads=False``), as shardwise scales it, so the gradients
and the work are the same.

The systems take turns for ``--rounds`` rounds (every other round in reverse order), each turn
in a fresh pair of rank processes (``RankPool``), so every system sees the same drift of the
machine. Per system: the median step
(the slowest rank's, between barriers, over every timed step of every round), its ratio to
torch's schedule of the same kind, the bytes each rank sends per step (shardwise:
``comm_stats()``; torch: its batched sends, counted by wrapping, plus the tied all_reduce) and
the losses (the last stage's, which must agree across systems). ``--profile``: the mean time
splits of a step per rank (``pipeline_profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
from pipeline_profile import Splits, mean_splits, wrap_shardwise, wrap_torch
from pipeline_schedules import gpt_loss
from provenance import source_version
from tp_vs_dp import OPTIM, MiB
from tp_vs_dp import _batches as batches

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.plans.gpt import pipeline_layers

COMPUTE = ("F compute", "B compute", "loss", "optimizer")
OPS = ("send", "all_reduce", "broadcast")  # what a rank sends (recv: what it gets)
SYSTEMS = {
    "sw_1f1b": ("shardwise", "1f1b"),
    "torch_1f1b": ("torch", "1f1b"),
    "sw_gpipe": ("shardwise", "gpipe"),
    "torch_gpipe": ("torch", "gpipe"),
    # the executor with its receives not posted ahead (each posted by its action, as before)
    "sw_1f1b_noahead": ("shardwise", "1f1b"),
    "sw_gpipe_noahead": ("shardwise", "gpipe"),
}
DEFAULT_SYSTEMS = "sw_1f1b,torch_1f1b,sw_gpipe,torch_gpipe"


class _Stage(torch.nn.Module):
    """One stage of a ``PipelineModule`` as a module of its own (what torch's stage wraps)."""

    def __init__(self, pipe: Any, stage: int) -> None:
        super().__init__()
        self.pipe, self.stage = pipe, stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.pipe.forward_stage(self.stage, x)
        return out


def _torch_runner(pipe: Any, kind: str, cfg: GPTConfig, seqs: int, m: int, splits: Any) -> Any:
    """A callable running one torch step; ``sent`` counts the bytes of its batched sends."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining import schedules as torch_schedules

    mb = seqs // m
    s = pipe.pp_rank
    # static shapes (no inference messages); the activation needs a gradient on both sides
    act = torch.empty(mb, cfg.seq_len, cfg.d_model, requires_grad=True)
    if s == 0:
        inp, out = torch.zeros(mb, cfg.seq_len, dtype=torch.long), act
    else:
        inp, out = act, torch.empty(mb, cfg.seq_len, cfg.vocab_size)
    grads = {"output_grads": act} if s == 0 else {"input_grads": act}
    stage = PipelineStage(
        _Stage(pipe, s), s, 2, torch.device("cpu"), inp, out, group=pipe.pp_group.pg, **grads
    )
    cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    sched = cls(stage, m, loss_fn=lambda o, y: gpt_loss(o, y) / m, scale_grads=False)
    sent = [0]
    batch_p2p = torch_schedules._batch_p2p

    def counted(ops: list[Any], desc: str | None = None) -> Any:
        sent[0] += sum(
            o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.isend
        )
        return batch_p2p(ops, desc=desc)

    torch_schedules._batch_p2p = counted
    if splits is not None:
        wrap_torch(splits, sched, stage)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        # torch's outputs are not kept (shardwise's are not): no merge of the logits
        if s == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        pipe.reduce_tied_grads()
        return float(sum(x.detach() for x in losses)) if losses else float("nan")

    return step, sent


def run_rank(system: str, model: str, seqs: int, m: int, steps: int, warmup: int, prof: bool):
    import shardwise
    from shardwise import comm
    from shardwise.parallel.pipeline import PipelineExecutor, PipelineModule

    lib, kind = SYSTEMS[system]
    cfg = GPTConfig.named(model)
    torch.manual_seed(0)
    pipe = PipelineModule(pipeline_layers(GPT(cfg)), gpt_loss, shardwise.Mesh(pp=2, dp=1))
    opt = torch.optim.AdamW(pipe.parameters(), **OPTIM)
    splits = Splits() if prof else None
    if lib == "torch":
        step, sent = _torch_runner(pipe, kind, cfg, seqs, m, splits)
    else:
        run = PipelineExecutor(pipe, kind, microbatches=m)
        if system.endswith("_noahead"):
            run._post_ahead = lambda ahead: None  # type: ignore[method-assign]
        if splits is not None:
            wrap_shardwise(splits, run)
        step, sent = (lambda x, y: float(run.train_batch(x, y))), [0]
    if splits is not None:
        splits.wrap(pipe, "reduce_tied_grads", "tied all_reduce")
        splits.wrap(opt, "step", "optimizer")
        splits.wrap(opt, "zero_grad", "optimizer")
    world = comm.world()
    times, cpus, losses, split_steps, per_step = [], [], [], [], {}
    for i, (x, y) in enumerate(batches(cfg, seqs, warmup + steps)):
        comm.barrier(group=world)
        comm.comm_stats(reset=True)
        sent[0] = 0
        t0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
        loss = step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        cpu = (time.process_time() - cpu0, time.thread_time() - main0)
        stats = comm.comm_stats(reset=True)
        losses.append(loss)
        took = splits.take(dt) if splits is not None else None
        if i >= warmup:
            times.append(dt)
            cpus.append(cpu)
            per_step = {op: s["bytes"] for op, s in stats.items() if op != "barrier"}
            if sent[0]:
                per_step["send"] = per_step.get("send", 0) + sent[0]
            if took is not None:
                split_steps.append(took)
    return {
        "times": times,
        "cpu": cpus,  # (all threads, main thread) CPU seconds per step
        "losses": losses,
        "bytes": per_step,
        "splits": mean_splits(split_steps) if prof else None,
    }


def _row(system: str, rounds: list[list[dict]]) -> dict:
    # a step's time is its slowest rank's; the median is over every timed step of every round
    step_s = [max(s) for results in rounds for s in zip(*(r["times"] for r in results))]
    last = rounds[-1]
    row = {
        "system": system,
        "step_s_median": statistics.median(step_s),
        "step_s_all": step_s,
        "bytes_per_step": [r["bytes"] for r in last],
        "losses": last[-1]["losses"],  # the last stage's
        # per rank: median CPU seconds per step of all its threads and of its main thread
        "cpu_s": [
            [statistics.median(c[k] for r in rounds for c in r[rank]["cpu"]) for k in (0, 1)]
            for rank in range(len(last))
        ],
    }
    if last[0]["splits"] is not None:
        row["splits"] = [
            mean_splits([r[rank]["splits"] for r in rounds]) for rank in range(len(last))
        ]
    return row


def _print(rows: list[dict], args: Any, load: tuple[float, float], cfg: GPTConfig) -> None:
    print(
        f"# {args.model} pp2 m={args.microbatches}, {args.seqs} x {cfg.seq_len} tokens per step, "
        f"{args.rounds} interleaved rounds of {args.steps} timed steps, code {source_version()}, "
        f"load average {load[0]:.2f} before, {load[1]:.2f} after"
    )
    by = {r["system"]: r for r in rows}
    ref = rows[0]["losses"]
    for r in rows:
        kind = SYSTEMS[r["system"]][1]
        base = by.get(f"torch_{kind}")
        ratio = f" ({r['step_s_median'] / base['step_s_median']:.3f}x torch)" if base else ""
        sent = ", ".join(
            "+".join(f"{b[op] / MiB:.2f}" for op in OPS if op in b)
            + f"={sum(b.get(op, 0) for op in OPS) / MiB:.2f}"
            for b in r["bytes_per_step"]
        )
        cpu = ", ".join(f"{a:.2f}/{m:.2f}" for a, m in r["cpu_s"])
        dev = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        print(
            f"{r['system']:>12}: step {r['step_s_median']:.3f} s{ratio}, sent MiB/step per rank "
            f"{sent} ({' + '.join(OPS)}), CPU s/step per rank all/main thread {cpu}, losses "
            f"{' '.join(f'{x:.5f}' for x in r['losses'])} (max rel. diff {dev:.1e})"
        )
        for rank, sp in enumerate(r.get("splits", [])):
            parts = ", ".join(
                f"{k} {v * 1e3:.0f}"
                + (f"/{sp['calls'][k]:.0f}" if sp["calls"].get(k) else "")
                + (f" ({sp['first'][k] * 1e3:.0f})" if sp["calls"].get(k, 0) > 1 else "")
                for k, v in sorted(sp["seconds"].items(), key=lambda kv: -kv[1])
            )
            print(f"{'':>14}rank {rank} ms/step/calls (the first call's ms): {parts}")
            compute = ", ".join(f"{k} {sp['cpu'][k] * 1e3:.0f}" for k in COMPUTE if k in sp["cpu"])
            print(f"{'':>14}rank {rank} CPU ms/step of the main thread: {compute}")
    _print_paired(by, args.steps)


def _print_paired(by: dict[str, dict], steps: int) -> None:
    """Each round's median step against torch's of the same round (the two ran one after the
    other): the machine's speed drifts between rounds more than the systems differ."""
    for name, r in by.items():
        base = by.get(f"torch_{SYSTEMS[name][1]}")
        if base is None or base is r:
            continue
        mine, theirs = (
            [
                statistics.median(x["step_s_all"][i : i + steps])
                for i in range(0, len(x["step_s_all"]), steps)
            ]
            for x in (r, base)
        )
        ratios = [a / b for a, b in zip(mine, theirs)]
        mean = statistics.mean(r["step_s_all"]) / statistics.mean(base["step_s_all"])
        print(
            f"{name:>12}: per round vs torch {' '.join(f'{x:.3f}' for x in ratios)}; median of "
            f"those {statistics.median(ratios):.3f}; mean step {mean:.3f}x torch's"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="anchor")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="turns of every system")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per step")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"of {', '.join(SYSTEMS)}")
    ap.add_argument("--profile", action="store_true", help="time splits per rank")
    ap.add_argument("--json")
    ap.add_argument("--reprint", help="print the tables of a saved --json (same --rounds, --steps)")
    args = ap.parse_args()
    if args.reprint:
        with open(args.reprint) as f:
            saved = json.load(f)
        print(f"# reprinted from {args.reprint} (code {saved['source']})")
        _print(saved["rows"], args, tuple(saved["load"]), GPTConfig.named(args.model))
        return
    from shardwise.testing import RankPool

    systems = args.systems.split(",")
    for system in systems:
        if system not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    cfg = GPTConfig.named(args.model)
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems}
    load0 = os.getloadavg()[0]
    for i in range(args.rounds):
        # every other round in reverse: a drift of the machine's load over a round falls on
        # every system alike
        for system in systems if i % 2 == 0 else systems[::-1]:
            pool = RankPool(2, pg_timeout_s=600.0, start_timeout_s=300.0)
            try:
                a = (system, args.model, args.seqs, args.microbatches, args.steps, args.warmup)
                runs[system].append(pool.run(run_rank, *a, args.profile, timeout_s=3600))
            finally:
                pool.close()
    rows = [_row(s, rounds) for s, rounds in runs.items()]
    load = (load0, os.getloadavg()[0])
    _print(rows, args, load, cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": source_version(), "load": load, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

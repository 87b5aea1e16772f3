"""ZeRO-3 under a pipeline: gather each stage's parameters per micro-batch (regather) or once per
step (keep), at dp2 x pp2.

    python benchmarks/pipeline_zero3.py [--model medium] [--microbatches 4] [--steps 3]
        [--seqs 8] [--json F]

The trade-off ``Config(pipeline_zero3_regather=...)`` makes: regather frees a stage's full
parameters between micro-batches (the peak holds one unit's) and gathers them 2m times a step;
keep gathers them once and holds the stage's full parameters for the whole step. Per mode: the
slowest rank's median step, all_gather bytes per step and rank, the most parameter bytes held
at once (full parameters gathered, from the engine's flat buffers), peak RSS per rank. Four
processes on this machine's 2 cores: compare the two modes with each other, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from provenance import source_version

OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def run_rank(regather: bool, model_name: str, m: int, seqs: int, steps: int) -> dict:
    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.pipeline import PipelineModule
    from shardwise.parallel.plans.gpt import pipeline_layers

    torch.set_num_threads(1)
    cfg = GPTConfig.named(model_name)
    mesh = shardwise.Mesh(dp=2, pp=2)
    torch.manual_seed(0)
    pipe = PipelineModule(pipeline_layers(GPT(cfg)), _loss, mesh, "parameters")
    config = shardwise.Config(
        zero_stage=3,
        pipeline_schedule="1f1b",
        pipeline_microbatches=m,
        pipeline_zero3_regather=regather,
    )
    engine = shardwise.initialize(pipe, torch.optim.AdamW(pipe.parameters(), **OPTIM), config,
                                  group=mesh)  # fmt: skip
    flats = [f for f in engine.flats if f.stage.shard_params]
    held = [0]

    def watching(wait: object) -> object:
        def wait_then_measure() -> None:  # a gather just completed: the most held right now
            wait()  # type: ignore[operator]
            now = sum(g.padded * g.full.element_size() for g in flats if g.holds_values)
            held[0] = max(held[0], now)

        return wait_then_measure

    for f in flats:
        f.wait_gather = watching(f.wait_gather)
    gen = torch.Generator().manual_seed(1 + mesh.rank("dp"))
    times, gathered = [], []
    for i in range(steps + 1):
        x = torch.randint(0, cfg.vocab_size, (seqs // 2, cfg.seq_len + 1), generator=gen)
        shardwise.barrier()
        mesh.stats.snapshot(reset=True)
        t0 = time.perf_counter()
        engine.train_batch(x[:, :-1], x[:, 1:])
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        bytes_ = mesh.stats.snapshot(reset=True).get("all_gather", {"bytes": 0})["bytes"]
        shardwise.comm.all_reduce(dt, "max", shardwise.comm.world())
        if i:
            times.append(float(dt.item()))
            gathered.append(int(bytes_))
    return {
        "step_s": statistics.median(times),
        "all_gather_bytes": gathered[-1],
        "held_full_param_bytes": held[0],
        "flats": len(flats),
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> int:
    from shardwise.testing import RankPool

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="medium")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seqs", type=int, default=8, help="sequences per step, both dp ranks")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    print(f"# pipeline_zero3 @ {source_version()}: {args.model}, dp2 x pp2, 1f1b, "
          f"m={args.microbatches}, {args.seqs} sequences per step")  # fmt: skip
    rows = {}
    for regather in (True, False):
        pool = RankPool(4, pg_timeout_s=900.0, start_timeout_s=300.0)
        try:
            out = pool.run(run_rank, regather, args.model, args.microbatches, args.seqs,
                           args.steps, timeout_s=3600)  # fmt: skip
        finally:
            pool.close()
        rows["regather" if regather else "keep"] = out
    print(f"ZeRO-3 buffers per stage: {[r['flats'] for r in rows['keep']]}")
    print(f"{'mode':<9} {'step s':>7} {'all_gather MiB/rank':>20} {'held full MiB (max)':>20} "
          f"{'peak RSS MiB (max)':>19}")  # fmt: skip
    for mode, out in rows.items():
        print(f"{mode:<9} {out[0]['step_s']:>7.3f} "
              f"{max(r['all_gather_bytes'] for r in out) / 2**20:>20.2f} "
              f"{max(r['held_full_param_bytes'] for r in out) / 2**20:>20.2f} "
              f"{max(r['maxrss_mib'] for r in out):>19.0f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": source_version(), "args": vars(args), "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

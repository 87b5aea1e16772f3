"""The cost model against measured steps of the built-in GPT on this machine (gloo, CPU).

    python benchmarks/costmodel_local.py [--model anchor] [--micro-batch 4] [--steps 4]

1. Calibration at one rank: the measured step time of the model at dp=1, less the predicted
   optimizer time, gives the effective FLOP/s of this machine's kernels (one thread per rank).
2. ``shardwise.topology.discover`` measures the link between the two ranks, and a copy the
   memory bandwidth; together they form ``costmodel.hardware.measured``.
3. At two ranks, ZeRO-0 and ZeRO-3 steps are measured and set beside the model's prediction
   (median step over ``--steps`` after one warm-up). The target is +-25%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from provenance import source_version

import shardwise
from shardwise import comm
from shardwise.costmodel import Plan, predict, shape
from shardwise.costmodel.hardware import measure_memory_bandwidth
from shardwise.models import GPT, GPTConfig
from shardwise.testing import RankPool
from shardwise.topology import discover


def _steps(model_name: str, zero: int, micro: int, steps: int) -> float:
    """Median seconds of a training step on every rank (the slowest rank's)."""
    torch.set_num_threads(1)
    cfg = GPTConfig.named(model_name)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = shardwise.initialize(model, opt, shardwise.Config(zero_stage=zero))
    x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1))
    times = []
    for i in range(steps + 1):
        comm.barrier(group=comm.world())
        t0 = time.perf_counter()
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        comm.all_reduce(dt, "max", comm.world())
        if i:
            times.append(float(dt.item()))
    return statistics.median(times)


def _links() -> tuple:
    torch.set_num_threads(1)
    links = discover(comm.world(), reps=10).links()
    return links.intra, links.inter, measure_memory_bandwidth()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="anchor")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    m = shape(args.model)
    print(f"# costmodel_local @ {source_version()}: {args.model}, micro-batch {args.micro_batch}")
    one = RankPool(1)
    try:
        t1 = one.run(_steps, args.model, 0, args.micro_batch, args.steps, timeout_s=3600)[0]
    finally:
        one.close()
    two = RankPool(2)
    try:
        intra, inter, membw = two.run(_links, timeout_s=600)[0]
        measured = {z: two.run(_steps, args.model, z, args.micro_batch, args.steps,
                               timeout_s=3600)[0] for z in (0, 3)}  # fmt: skip
    finally:
        two.close()
    base = Plan(micro_batch=args.micro_batch, precision="fp32")
    ref = shardwise.costmodel.measured((intra, inter), 2, 1.0, 1 << 40, membw)
    one_rank = predict(m, base, ref)  # at 1 FLOP/s: compute seconds = FLOPs per step
    compute_s = t1 - one_rank.breakdown["optimizer"]  # the rest of the dp=1 step is compute
    hw = shardwise.costmodel.measured(
        (intra, inter), 2, one_rank.breakdown["compute"] / compute_s, 1 << 40, membw
    )
    print(f"calibration: dp=1 step {t1:.3f} s -> {hw.peak_flops / 1e9:.1f} GFLOP/s; link "
          f"alpha {intra.alpha_s * 1e6:.0f} us, {1 / intra.beta_s_per_byte / 1e9:.2f} GB/s; "
          f"memory {membw / 1e9:.1f} GB/s")  # fmt: skip
    print(f"{'plan':<52} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for z, seconds in measured.items():
        plan = Plan(dp=2, micro_batch=args.micro_batch, zero_stage=z, precision="fp32")
        pred = predict(m, plan, hw)
        print(f"{plan.describe():<52} {seconds:>10.3f} {pred.step_s:>11.3f} "
              f"{seconds / pred.step_s - 1:>+7.0%}")  # fmt: skip
        print("  breakdown: " + ", ".join(f"{k} {v:.3f}" for k, v in pred.breakdown.items()))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())

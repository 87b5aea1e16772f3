"""Tensor parallelism (tp=2, with and without sequence parallelism) against data parallelism
(dp=2, shardwise ZeRO-0) on the same global batch.

    python benchmarks/tp_vs_dp.py [--model anchor] [--steps 6] [--warmup 2] [--seqs 8]
        [--systems dp2,tp2,tp2sp] [--json out.json]

dp=2 runs through the engine (ZeRO-0); tp=2 has no dp axis to reduce over and steps a plain
AdamW after backward. The problem is the anchor one (shared/ANCHORS.md): GPT "anchor", 8
sequences of 256 tokens per step in all (dp: 4 per rank; tp: all 8 on both ranks), AdamW(lr
1e-3, betas (0.9, 0.95), weight decay 0.1), fp32, gloo, one thread per rank. Every system
starts from the same weights and sees the same batches, so the losses agree (a correctness
cross-check).

Each system runs in fresh rank processes, so its peak RSS is its own. A step's time is the
slowest rank's, between barriers. Bytes per step are the payload ``comm_stats()`` counts. For
tp, the activation traffic of the transformer layers (all collectives of b·s·h elements: the
4 per layer, minus the embedding's and the head's) is set next to Megatron-LM's
8·b·s·h·(t-1)/t elements per layer per device (Narayanan et al. 2021, sec. 3.2): a ring moves
2(t-1)/t of an all_reduce's payload per device, and (t-1)/t of an all_gather's or
reduce_scatter's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

import torch
from provenance import source_version

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.plans.gpt import tp_plan

SYSTEMS = {
    "dp2": "data parallel, shardwise ZeRO-0, dp=2",
    "tp2": "tensor parallel, tp=2",
    "tp2sp": "tensor + sequence parallel, tp=2",
}
OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
MiB = 1 << 20
WIRE = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}  # x (t-1)/t of payload


def _batches(cfg: GPTConfig, seqs: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shape = (seqs, cfg.seq_len)
    return [
        (
            torch.randint(0, cfg.vocab_size, shape, generator=gen),
            torch.randint(0, cfg.vocab_size, shape, generator=gen),
        )
        for _ in range(steps)
    ]


def _build(system: str, cfg: GPTConfig) -> tuple[Any, Any, Any, int]:
    """(model or engine, optimizer or engine, TensorParallel or None, batch share or -1)."""
    import shardwise
    from shardwise.mesh import Mesh
    from shardwise.parallel import tensor as swtp

    torch.manual_seed(0)
    model = GPT(cfg)
    if system == "dp2":
        opt = torch.optim.AdamW(model.parameters(), **OPTIM)
        engine = shardwise.initialize(model, opt, shardwise.Config(zero_stage=0))
        return engine, engine, None, shardwise.rank()
    mesh = Mesh(dp=1, tp=2)
    tp = swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=system == "tp2sp")
    return model, torch.optim.AdamW(model.parameters(), **OPTIM), tp, -1


def run_rank(system: str, model_name: str, seqs: int, steps: int, warmup: int) -> dict:
    from shardwise import comm

    cfg = GPTConfig.named(model_name)
    model, opt, tp, share = _build(system, cfg)
    world = comm.world()
    times, losses, per_step, fwd_bwd = [], [], [], []
    for i, (x, y) in enumerate(_batches(cfg, seqs, warmup + steps)):
        if share >= 0:  # data parallel: this rank's half of the global batch
            x, y = x.chunk(2)[share], y.chunk(2)[share]
        comm.barrier(group=world)
        comm.comm_stats(reset=True)
        t0 = time.perf_counter()
        loss = model(x, y)
        if tp is None:
            model.backward(loss)
            model.step()
            passes = {}
        else:
            loss.backward()
            passes = comm.comm_stats()  # forward + backward
            opt.step()
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        stats = comm.comm_stats(reset=True)
        if i >= warmup:
            times.append(dt)
            per_step.append({op: s["bytes"] for op, s in stats.items()})
            fwd_bwd.append({op: s["bytes"] for op, s in passes.items()})
        losses.append(loss.item())
    return {
        "times": times,
        "losses": losses,
        "bytes": per_step[-1] if per_step else {},
        "fwd_bwd_bytes": fwd_bwd[-1] if fwd_bwd else {},
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "partial_grad_bytes": 0 if tp is None else 4 * sum(p.numel() for p in tp.partial_params()),
    }


def _activation_check(
    cfg: GPTConfig, seqs: int, stats: dict[str, int], sp: bool, partial_grad_bytes: int
) -> str:
    """Layer activation traffic per device vs Megatron's 8bsh(t-1)/t elements per layer."""
    t, h, tokens = 2, cfg.d_model, seqs * cfg.seq_len
    bsh_bytes = tokens * h * 4
    # the vocab-parallel loss (3 all_reduces of b*s) and, under SP, the gradients of the
    # replicated parameters used on 1/tp of the sequence
    loss_bytes = 3 * tokens * 4 + partial_grad_bytes
    # outside the layers: the embedding (fwd) and the head's input (bwd), one b*s*h each way
    if sp:  # embedding RS fwd + AG bwd, head AG fwd + RS bwd (+ its regather in bwd); each
        # layer's 2 regathers in backward are the price of keeping 1/t of the activations,
        # outside Megatron's formula: counted apart
        regather = (2 * cfg.n_layer + 1) * bsh_bytes
        outside = {"all_gather": 2 * bsh_bytes + regather, "reduce_scatter": 2 * bsh_bytes}
    else:
        outside = {"all_reduce": 2 * bsh_bytes}
    wire = 0.0
    for op, factor in WIRE.items():
        payload = stats.get(op, 0) - outside.get(op, 0)
        payload -= loss_bytes if op == "all_reduce" else 0
        wire += payload * factor * (t - 1) / t
    per_layer = wire / cfg.n_layer / 4
    megatron = 8 * tokens * h * (t - 1) / t
    return f"{per_layer:,.0f} elements/layer/device vs Megatron {megatron:,.0f}"


def _report(system: str, cfg: GPTConfig, seqs: int, results: list[dict]) -> dict:
    steps = list(zip(*(r["times"] for r in results)))
    step_s = [max(s) for s in steps]
    # data parallel: each rank's loss is its half-batch mean; the global loss is their mean
    losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in results))]
    row = {
        "system": system,
        "step_s_median": statistics.median(step_s) if step_s else None,
        "bytes_per_step": results[0]["bytes"],
        "maxrss_mib": [r["maxrss_mib"] for r in results],
        "losses": losses,
    }
    if system != "dp2":
        fb = results[0]["fwd_bwd_bytes"]
        partial = results[0]["partial_grad_bytes"]
        row["activation_traffic"] = _activation_check(cfg, seqs, fb, system == "tp2sp", partial)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="anchor")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per step, all ranks together")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--json")
    args = ap.parse_args()
    from shardwise.testing import RankPool

    cfg = GPTConfig.named(args.model)
    rows = []
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        pool = RankPool(2, pg_timeout_s=600.0, start_timeout_s=300.0)
        try:
            res = pool.run(
                run_rank, system, args.model, args.seqs, args.steps, args.warmup, timeout_s=3600
            )
        finally:
            pool.close()
        rows.append(_report(system, cfg, args.seqs, res))
    print(f"# {args.model}, {args.seqs} x {cfg.seq_len} tokens per step, code {source_version()}")
    for r in rows:
        mib = {op: round(b / MiB, 2) for op, b in r["bytes_per_step"].items()}
        rss = ", ".join(f"{m:.0f}" for m in r["maxrss_mib"])
        print(
            f"{r['system']:>6} ({SYSTEMS[r['system']]}): step {r['step_s_median']:.3f} s, "
            f"MiB/step {mib}, peak RSS {rss} MiB, final loss {r['losses'][-1]:.4f}"
        )
        if "activation_traffic" in r:
            print(f"        layer activations: {r['activation_traffic']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": source_version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

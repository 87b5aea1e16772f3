"""Context parallelism (cp=2, ring and all-to-all) against data parallelism (dp=2) and tensor
parallelism (tp=2) on the anchor GPT at a sequence 4x its default, and torch's own
``torch.distributed.tensor.experimental.context_parallel`` where it runs on CPU.

    python benchmarks/context_parallel.py [--model anchor] [--seq-factor 4] [--seqs 2]
        [--steps 4] [--warmup 1] [--rounds 3] [--systems dp2,tp2,cp2_ring,cp2_a2a,torch_cp2]
        [--json out]

Every shardwise system goes through ``plans.gpt.plan`` + ``shardwise.parallelize`` +
``shardwise.initialize`` (ZeRO-0, fp32, AdamW lr 1e-3, gloo, one thread per rank), from the
same weights on the same batches (``--seqs`` sequences per step in all: dp splits them, tp and
cp run all of them), so the losses agree. Per system: the median step (slowest rank, between
barriers; the systems take turns for ``--rounds`` rounds, each in a fresh pair of processes, so
every system sees the same drift of the machine), the bytes ``comm_stats()`` counts per step,
the bytes the forward saves for backward on a rank (``shardwise.testing.SavedTensorBytes``:
the activations), and the peak RSS of a rank.
torch's context parallelism is tried on one causal attention call (its ring over the device
mesh); on CPU it is reported as the error it raises, if it raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import time

import torch
from provenance import source_version

from shardwise.models.gpt import GPT, GPTConfig

SYSTEMS = {
    "dp2": ("dp", 2, "ring"),
    "tp2": ("tp", 2, "ring"),
    "cp2_ring": ("cp", 2, "ring"),
    "cp2_a2a": ("cp", 2, "all_to_all"),
}
TORCH_CP = "torch_cp2"
MiB = 1 << 20


def _config(model: str, factor: int) -> GPTConfig:
    cfg = GPTConfig.named(model)
    return dataclasses.replace(cfg, seq_len=cfg.seq_len * factor)


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


def run_rank(system: str, model: str, factor: int, seqs: int, steps: int, warmup: int) -> dict:
    import shardwise
    from shardwise import comm
    from shardwise.parallel import plans
    from shardwise.testing import SavedTensorBytes

    torch.set_num_threads(1)
    axis, size, method = SYSTEMS[system]
    cfg = _config(model, factor)
    mesh = shardwise.Mesh(**{axis: size})
    torch.manual_seed(0)
    par = shardwise.parallelize(GPT(cfg), mesh, plans.gpt.plan(cfg, mesh, cp_method=method))
    opt = torch.optim.AdamW(par.module.parameters(), lr=1e-3)
    engine = shardwise.initialize(par, opt, shardwise.Config(zero_stage=0))
    loss_of = plans.gpt.loss(cfg, mesh)
    world = comm.world()
    times, losses, per_step, saved = [], [], {}, 0
    for i, (x, y) in enumerate(_batches(cfg, seqs, warmup + steps)):
        if axis == "dp":
            x, y = x.chunk(size)[mesh.rank("dp")], y.chunk(size)[mesh.rank("dp")]
        if par.context is not None:
            x, y = par.context.split(x, y)
        comm.barrier(group=world)
        comm.comm_stats(reset=True)
        t0 = time.perf_counter()
        acts = SavedTensorBytes(par.module)
        loss = acts.measure(lambda x=x, y=y: loss_of(engine(x), y))
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        stats = comm.comm_stats(reset=True)
        if i >= warmup:
            times.append(dt)
            per_step = {op: s["bytes"] for op, s in stats.items()}
            saved = acts.total
        losses.append(loss.item())
    return {
        "times": times,
        "losses": losses,
        "bytes": per_step,
        "saved_bytes": saved,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def torch_cp_rank(model: str, factor: int) -> str:
    """One causal attention call of the model's shape under torch's context parallelism."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    cfg = _config(model, factor)
    mesh = init_device_mesh("cpu", (2,))
    shape = (1, cfg.n_head, cfg.seq_len, cfg.d_model // cfg.n_head)
    q, k, v = (torch.randn(shape) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return f"ran: output {tuple(out.shape)} per rank"
    except Exception as exc:  # reported, not hidden: what torch says on CPU
        return f"does not run on CPU/gloo: {type(exc).__name__}: {str(exc).splitlines()[0]}"


def _row(system: str, rounds: list[list[dict]]) -> dict:
    # A step's time is its slowest rank's; the median is over every timed step of every round.
    step_s = [max(s) for results in rounds for s in zip(*(r["times"] for r in results))]
    results = rounds[-1]
    losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in results))]
    return {
        "system": system,
        "step_s_median": statistics.median(step_s),
        "step_s_all": step_s,
        "bytes_per_step": results[0]["bytes"],
        "saved_activation_mib": [r["saved_bytes"] / MiB for r in results],
        "maxrss_mib": [max(r[i]["maxrss_mib"] for r in rounds) for i in range(len(results))],
        "losses": losses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="anchor")
    ap.add_argument("--seq-factor", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=2, help="sequences per step, all ranks together")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="turns of every system")
    ap.add_argument("--systems", default=",".join([*SYSTEMS, TORCH_CP]))
    ap.add_argument("--json")
    args = ap.parse_args()
    from shardwise.testing import RankPool

    cfg = _config(args.model, args.seq_factor)
    systems = args.systems.split(",")
    for system in systems:
        if system not in (*SYSTEMS, TORCH_CP):
            raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems if s in SYSTEMS}
    torch_cp = None
    load = os.getloadavg()
    for _ in range(args.rounds):
        for system in systems:
            if system == TORCH_CP and torch_cp is not None:
                continue
            pool = RankPool(2, pg_timeout_s=600.0, start_timeout_s=300.0)
            try:
                if system == TORCH_CP:
                    torch_cp = pool.run(torch_cp_rank, args.model, args.seq_factor)[0]
                    continue
                a = (system, args.model, args.seq_factor, args.seqs, args.steps, args.warmup)
                runs[system].append(pool.run(run_rank, *a, timeout_s=3600))
            finally:
                pool.close()
    rows = [_row(system, rounds) for system, rounds in runs.items()]
    load_end = os.getloadavg()
    print(
        f"# {args.model} at seq {cfg.seq_len} ({args.seq_factor}x), {args.seqs} sequences per "
        f"step, 2 ranks, {args.rounds} interleaved rounds of {args.steps} timed steps, code "
        f"{source_version()}, load average {load[0]:.2f} before, {load_end[0]:.2f} after"
    )
    base = rows[0]["step_s_median"] if rows else 1.0
    for r in rows:
        mib = {op: round(b / MiB, 2) for op, b in r["bytes_per_step"].items()}
        acts = ", ".join(f"{m:.1f}" for m in r["saved_activation_mib"])
        rss = ", ".join(f"{m:.0f}" for m in r["maxrss_mib"])
        print(
            f"{r['system']:>9}: step {r['step_s_median']:.3f} s "
            f"({r['step_s_median'] / base:.2f}x {rows[0]['system']}), MiB/step {mib}, activations "
            f"{acts} MiB/rank, peak RSS {rss} MiB, final loss {r['losses'][-1]:.4f}"
        )
    if torch_cp is not None:
        print(f"{TORCH_CP:>9}: {torch_cp}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": source_version(), "rows": rows, TORCH_CP: torch_cp}, f, indent=1)


if __name__ == "__main__":
    main()

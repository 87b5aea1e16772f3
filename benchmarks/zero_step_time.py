"""Step time and memory of shardwise ZeRO 0-3 next to torch DDP, torch FSDP2 and DeepSpeed.

    python benchmarks/zero_step_time.py [--steps 6] [--warmup 2] [--rounds 1]
        [--systems sw0,sw1,sw2,sw3,ddp,fsdp2,ds1,ds2,ds3] [--json out.json]
        [--deepspeed-python /path/to/venv/bin/python] [--profile-steps N]

The problem is the reference one (shared/ANCHORS.md): GPT "anchor" (23.24 M parameters, tied
head), 4 sequences of 256 tokens per rank, world size 2 on gloo, AdamW(lr 1e-3, betas
(0.9, 0.95), weight decay 0.1), fp32, one thread per rank. Every system starts from the same
weights and sees the same batches, so their losses agree (a correctness cross-check).

Each system runs in fresh rank processes (a new ``RankPool``), so its peak RSS (ru_maxrss is a
process-lifetime peak) is its own. ``--rounds R`` runs the whole list R times (the order reversed
every other round) so that drifting background load does not favour whoever ran first; timed
steps from all rounds are pooled. A step's time is the slowest rank's; forward, backward and
optimizer step are timed separately; a barrier outside the timed region separates steps. "CPU
s/step" is a rank's process CPU time over the step (all its threads: compute and gloo's); on a
shared machine, other tenants' load inflates it much less than the wall-clock step time.

Model state per rank is counted from the tensors that exist after the last backward (before its
optimizer step): shardwise from ``engine.memory()`` (params + grads + optimizer); DDP and FSDP2
from the parameters, their ``.grad`` and the optimizer's state tensors (local shards of DTensors);
DeepSpeed from the module's parameters and gradients plus its optimizer's flat fp32 master,
gradient partitions and state tensors. Each storage is counted once.

DeepSpeed runs in this interpreter when it can be imported; otherwise ``--deepspeed-python``
names an interpreter (a separate virtual environment) that has it, and each DeepSpeed system
runs there as a subprocess of this script. This file calls torch.distributed directly on purpose:
the other systems are the baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from provenance import source_version

from shardwise.models import GPT, GPTConfig

log = logging.getLogger("zero_step_time")

WORLD_SIZE = 2
SEQS_PER_RANK = 4
MODEL = "anchor"
OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
MiB = 1 << 20
SYSTEMS = {
    "sw0": "shardwise ZeRO-0",
    "sw1": "shardwise ZeRO-1",
    "sw2": "shardwise ZeRO-2",
    "sw3": "shardwise ZeRO-3",
    "ddp": "torch DDP",
    "fsdp2": "torch FSDP2 fully_shard",
    "ds1": "DeepSpeed ZeRO-1",
    "ds2": "DeepSpeed ZeRO-2",
    "ds3": "DeepSpeed ZeRO-3",
}
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": SEQS_PER_RANK,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
}
# DeepSpeed ZeRO optimizer attributes that hold model state (flat master, gradient partitions)
DS_STATE_ATTRS = (
    "bit16_groups_flat",
    "single_partition_of_fp32_groups",
    "averaged_gradients",
    "grads_in_partition",
    "fp16_partitioned_groups_flat",
    "fp32_partitioned_groups_flat",
    "grad_partitions_flat_buffer",
)


# ---- on every rank ----


@dataclass
class Trainer:
    """One system's training step split in phases, and how it counts its model state."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    state_bytes: Callable[[], dict[str, int]]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if callable(to_local) else t


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] + ([obj.grad] if obj.grad is not None else [])
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors_in(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors_in(x)]
    return []


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = _local(t).untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _optimizer_states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    # skip 0-d step counters: they are not model state
    return [
        v
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]


def torch_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """A plain torch model's state on this rank: parameters, their gradients, optimizer state."""
    params = list(model.parameters())
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": storage_bytes(_optimizer_states(opt)),
    }


def _shardwise(model: torch.nn.Module, stage: int) -> Trainer:
    import shardwise

    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    engine = shardwise.initialize(model, opt, shardwise.Config(zero_stage=stage))

    def state() -> dict[str, int]:
        m = engine.memory()
        return {k: m[k] for k in ("params", "grads", "optimizer")}

    return Trainer(engine, engine.backward, engine.step, state)


def _ddp(model: torch.nn.Module) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), **OPTIM)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    return Trainer(ddp, lambda loss: loss.backward(), step, lambda: torch_state_bytes(model, opt))


def _fsdp2(model: torch.nn.Module) -> Trainer:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    return Trainer(model, lambda loss: loss.backward(), step, lambda: torch_state_bytes(model, opt))


def _deepspeed(model: torch.nn.Module, stage: int) -> Trainer:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {**DS_CONFIG, "zero_optimization": {"stage": stage}}
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    torch.set_num_threads(1)
    return Trainer(
        engine, engine.backward, engine.step, lambda: deepspeed_state_bytes(engine, ds_opt)
    )


def deepspeed_state_bytes(engine: Any, ds_opt: Any) -> dict[str, int]:
    """A DeepSpeed engine's model state on this rank: its parameters (their partitions), its
    flat fp32 master and gradient partitions, the parameters' own gradients, optimizer state."""
    params = list(engine.module.parameters())
    own = [getattr(p, "ds_tensor", p) for p in params]
    grads = [p.grad for p in params if p.grad is not None]
    held = [t for a in DS_STATE_ATTRS for t in _tensors_in(getattr(ds_opt, a, None))]
    states = _optimizer_states(ds_opt.optimizer)
    # DeepSpeed's flat buffers include the one the parameters are views of: count each
    # storage once, parameters first, then the fp32 master and gradient partitions.
    params_b = storage_bytes(own)
    flat_b = storage_bytes(own + held) - params_b
    return {
        "params": params_b,
        "ds_flat": flat_b,
        "param_grads": storage_bytes(own + held + grads) - params_b - flat_b,
        "optimizer": storage_bytes(states),
    }


def _build(system: str, model: torch.nn.Module) -> Trainer:
    if system.startswith("sw"):
        return _shardwise(model, int(system[2:]))
    if system.startswith("ds"):
        return _deepspeed(model, int(system[2:]))
    return _ddp(model) if system == "ddp" else _fsdp2(model)


def batches(n: int, rank: int, vocab: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``n`` global batches for every system; this rank's sequences of each."""
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab, (n, WORLD_SIZE * SEQS_PER_RANK, seq + 1), generator=g)
    mine = data[:, rank * SEQS_PER_RANK : (rank + 1) * SEQS_PER_RANK]
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in mine]


def _comm_snapshot() -> dict[str, Any]:
    from shardwise import comm

    exposed = comm.exposed_comm_seconds()  # read first: comm_stats(reset=True) clears it too
    return {"ops": comm.comm_stats(reset=True), "exposed_s": exposed}


def _profile(trainer: Trainer, data: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """torch.profiler over a few extra (untimed) steps: this rank's top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in data:
            dist.barrier()
            trainer.backward(trainer.forward(x, y))
            trainer.step()
    return prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
    )


def _exposed_so_far(system: str) -> float:
    if not system.startswith("sw"):
        return 0.0
    from shardwise import comm

    return comm.exposed_comm_seconds()


def train_task(system: str, steps: int, warmup: int, profile_steps: int = 0) -> dict[str, Any]:
    """Runs on every rank: build ``system``, train ``warmup + steps`` steps, time each phase
    (wall clock, and this process's CPU time over all its threads)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = GPTConfig.named(MODEL)
    torch.manual_seed(0)
    model = GPT(cfg)
    trainer = _build(system, model)
    data = batches(warmup + steps + profile_steps, rank, cfg.vocab_size, cfg.seq_len)
    rec: dict[str, list[Any]] = {
        k: [] for k in ("step_s", "fwd_s", "bwd_s", "opt_s", "cpu_s", "loss", "comm")
    }
    state: dict[str, int] = {}
    for i, (x, y) in enumerate(data[: warmup + steps]):
        dist.barrier()
        if system.startswith("sw"):
            _comm_snapshot()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = trainer.forward(x, y)
        t1 = time.perf_counter()
        e1 = _exposed_so_far(system)
        trainer.backward(loss)
        t2, c2 = time.perf_counter(), time.process_time()
        e2 = _exposed_so_far(system)
        if i == warmup + steps - 1:
            state = trainer.state_bytes()
        c3, t3 = time.process_time(), time.perf_counter()
        trainer.step()
        t4, c4 = time.perf_counter(), time.process_time()
        if i < warmup:
            continue
        rec["step_s"].append((t2 - t0) + (t4 - t3))
        rec["fwd_s"].append(t1 - t0)
        rec["bwd_s"].append(t2 - t1)
        rec["opt_s"].append(t4 - t3)
        rec["cpu_s"].append((c2 - c0) + (c4 - c3))
        rec["loss"].append(float(loss.detach()))
        if system.startswith("sw"):  # where callers sat blocked: forward, backward, step
            snap = _comm_snapshot()
            snap["exposed_split_s"] = [e1, e2 - e1, snap["exposed_s"] - e2]
            rec["comm"].append(snap)
        else:
            rec["comm"].append(None)
    out = {
        **rec,
        "state": state,
        "threads": torch.get_num_threads(),
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if profile_steps:  # after the peak-RSS reading: the profiler's own memory is not counted
        out["profile"] = _profile(trainer, data[warmup + steps :])
    return out


# ---- in the launching process ----


def run_here(system: str, steps: int, warmup: int, profile_steps: int = 0) -> list[dict[str, Any]]:
    from shardwise.testing import RankPool

    pool = RankPool(WORLD_SIZE, pg_timeout_s=600.0, start_timeout_s=300.0)
    try:
        return pool.run(train_task, system, steps, warmup, profile_steps, timeout_s=3600.0)
    finally:
        pool.close()


def run_subprocess(
    python: str, system: str, steps: int, warmup: int, profile_steps: int = 0
) -> list[dict[str, Any]]:
    """One system in another interpreter (DeepSpeed's virtual environment)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cmd = [
            python,
            str(Path(__file__).resolve()),
            "--systems",
            system,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--rounds",
            "1",
            "--profile-steps",
            str(profile_steps),
            "--ranks-json",
            str(out),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{system} in {python} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return json.loads(out.read_text())[system][0]


def _slowest(per_rank: list[dict[str, Any]], key: str) -> list[float]:
    return [max(v) for v in zip(*(r[key] for r in per_rank))]


def _comm_per_step(per_rank_rounds: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    steps = [c for rnd in per_rank_rounds for c in rnd[0]["comm"] if c is not None]
    if not steps:
        return None
    ops: dict[str, dict[str, float]] = {}
    for s in steps:
        for op, v in s["ops"].items():
            o = ops.setdefault(op, {"calls": 0, "bytes": 0, "seconds": 0.0})
            for k in o:
                o[k] += v[k] / len(steps)
    split = [statistics.median(s["exposed_split_s"][i] for s in steps) for i in range(3)]
    return {
        "ops": ops,
        "exposed_s": statistics.median(s["exposed_s"] for s in steps),
        "exposed_split_s": split,
    }


def summarize(system: str, rounds: list[list[dict[str, Any]]], tokens: int) -> dict[str, Any]:
    """Pool the timed steps of every round: medians of the slowest rank's time per step."""
    out: dict[str, Any] = {"system": system, "label": SYSTEMS[system]}
    for key in ("step_s", "fwd_s", "bwd_s", "opt_s", "cpu_s"):
        vals = [v for rnd in rounds for v in _slowest(rnd, key)]
        out[key] = statistics.median(vals)
        if key == "step_s":
            out["step_s_all"] = vals
            out["step_s_min"] = min(vals)
            out["round_medians_s"] = [statistics.median(_slowest(r, key)) for r in rounds]
    out["tokens_per_s"] = tokens / out["step_s"]
    out["state_bytes"] = [rnd[r]["state"] for rnd in rounds[-1:] for r in range(len(rnd))]
    out["state_mib"] = max(sum(s.values()) for s in out["state_bytes"]) / MiB
    out["maxrss_mib"] = max(r["maxrss_mib"] for rnd in rounds for r in rnd)
    out["maxrss_mib_per_rank"] = [
        max(rnd[r]["maxrss_mib"] for rnd in rounds) for r in range(len(rounds[0]))
    ]
    out["final_loss"] = statistics.mean(r["loss"][-1] for r in rounds[-1])
    out["threads"] = sorted({r["threads"] for rnd in rounds for r in rnd})
    out["comm_per_step"] = _comm_per_step(rounds)
    return out


def _ratio(row: dict[str, Any], base: dict[str, Any] | None, key: str) -> str:
    return f"{row[key] / base[key]:.3f}" if base else "-"


def tables(rows: list[dict[str, Any]]) -> str:
    by = {r["system"]: r for r in rows}
    ddp, fsdp = by.get("ddp"), by.get("fsdp2")
    lines = [
        "| system | median step s | min s | tokens/s | step vs DDP | step vs FSDP2 "
        "| fwd s | bwd s | opt step s | CPU s/step/rank | CPU vs DDP "
        "| model state MiB/rank | state vs DDP "
        "| state vs FSDP2 | peak RSS MiB/rank | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['step_s']:.3f} | {r['step_s_min']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {_ratio(r, ddp, 'step_s')} | "
            f"{_ratio(r, fsdp, 'step_s')} | {r['fwd_s']:.3f} | {r['bwd_s']:.3f} | "
            f"{r['opt_s']:.3f} | {r['cpu_s']:.3f} | {_ratio(r, ddp, 'cpu_s')} | "
            f"{r['state_mib']:.1f} | {_ratio(r, ddp, 'state_mib')} | "
            f"{_ratio(r, fsdp, 'state_mib')} | "
            f"{' / '.join(f'{m:,.0f}' for m in r['maxrss_mib_per_rank'])} | "
            f"{r['final_loss']:.4f} |"
        )
    comm_rows = [r for r in rows if r["comm_per_step"]]
    if comm_rows:
        lines += [
            "",
            "shardwise collectives per timed step (rank 0; seconds: launch to "
            "completion, summed over calls that may overlap):",
            "",
            "| system | op | calls | MiB | seconds |",
            "|---|---|---|---|---|",
        ]
        for r in comm_rows:
            for op, v in sorted(r["comm_per_step"]["ops"].items()):
                lines.append(
                    f"| {r['label']} | {op} | {v['calls']:.0f} | "
                    f"{v['bytes'] / MiB:.1f} | {v['seconds']:.3f} |"
                )
        lines += [
            "",
            "time blocked waiting on shardwise collectives per step (rank 0, medians):",
            "",
            "| system | in forward s | in backward s | in step s | total s |",
            "|---|---|---|---|---|",
        ]
        for r in comm_rows:
            c = r["comm_per_step"]
            fwd, bwd, opt = c["exposed_split_s"]
            lines.append(
                f"| {r['label']} | {fwd:.3f} | {bwd:.3f} | {opt:.3f} | {c['exposed_s']:.3f} |"
            )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per system and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (per round)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times the system list is run (order reversed every other round)",
    )
    ap.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {','.join(SYSTEMS)}"
    )
    ap.add_argument("--json", type=Path, help="write the summary rows here")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the timed steps, run this many more under torch.profiler and "
        "print rank 0's top ops per system (default 0: no profiling)",
    )
    ap.add_argument(
        "--deepspeed-python",
        help="interpreter that can import deepspeed (used when this one cannot)",
    )
    ap.add_argument("--ranks-json", type=Path, help=argparse.SUPPRESS)  # per-rank raw results
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.profile_steps < 0:
        raise ValueError("--steps and --rounds must be >= 1, --warmup and --profile-steps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    ds_here = importlib.util.find_spec("deepspeed") is not None
    systems = [
        s for s in args.systems if not s.startswith("ds") or ds_here or args.deepspeed_python
    ]
    skipped = [s for s in args.systems if s not in systems]
    if skipped:
        log.info(
            "skipping %s: deepspeed is not importable here and --deepspeed-python is not set",
            ", ".join(skipped),
        )
    version = source_version()  # before the ranks import shardwise
    t_start = time.perf_counter()
    raw: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in systems}
    for rnd in range(args.rounds):
        for system in systems if rnd % 2 == 0 else systems[::-1]:
            t0 = time.perf_counter()
            if system.startswith("ds") and not ds_here:
                res = run_subprocess(
                    args.deepspeed_python, system, args.steps, args.warmup, args.profile_steps
                )
            else:
                res = run_here(system, args.steps, args.warmup, args.profile_steps)
            raw[system].append(res)
            log.info(
                "round %d %-6s median step %.3f s (%.0f s with start-up)",
                rnd + 1,
                system,
                statistics.median(_slowest(res, "step_s")),
                time.perf_counter() - t0,
            )
    if args.ranks_json:
        args.ranks_json.write_text(json.dumps(raw))
        return 0
    seq_len = GPTConfig.named(MODEL).seq_len
    tokens = WORLD_SIZE * SEQS_PER_RANK * seq_len
    rows = [summarize(s, raw[s], tokens) for s in systems]
    log.info(
        "\nGPT %s, world size %d (gloo), %d seq x %d tokens per rank, fp32, AdamW; "
        "%d round(s) x (%d warm-up + %d timed steps) per system; torch %s, shardwise %s\n",
        MODEL,
        WORLD_SIZE,
        SEQS_PER_RANK,
        seq_len,
        args.rounds,
        args.warmup,
        args.steps,
        torch.__version__,
        version,
    )
    log.info("%s", tables(rows))
    log.info(
        "\nper-round medians (s): %s",
        "; ".join(
            f"{r['system']} {', '.join(f'{m:.3f}' for m in r['round_medians_s'])}" for r in rows
        ),
    )
    for s in systems:
        for rnd, res in enumerate(raw[s]):
            if "profile" in res[0]:
                log.info(
                    "\n%s, round %d, rank 0 under torch.profiler (%d steps):\n%s",
                    SYSTEMS[s],
                    rnd + 1,
                    args.profile_steps,
                    res[0]["profile"],
                )
    log.info("threads per rank seen: %s", {r["system"]: r["threads"] for r in rows})
    log.info("total wall time %.0f s", time.perf_counter() - t_start)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "shardwise": version,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

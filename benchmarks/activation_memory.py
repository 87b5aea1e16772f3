"""Activation checkpointing: memory saved and the step-time cost of recomputation.

Trains the GPT problem of ANCHORS.md (23M parameters, 6 blocks, d_model 512, seq 256, 4 sequences
per rank, AdamW) through shardwise with and without ``activation_checkpointing=["Block"]``, each
in fresh rank processes, and prints per mode:

- activations kept for backward per rank: the bytes of every tensor autograd saves during the
  forward (parameters excluded), counted with saved-tensor hooks, plus, with checkpointing, the
  largest single block recompute (one block's activations, alive during its backward);
- peak memory per rank: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on CPU;
- median step time, and the recompute cost as the ratio checkpointed / plain.

    python benchmarks/activation_memory.py                     # CPU, 2 ranks, fp32
    python benchmarks/activation_memory.py --world-size 1 --precision bf16   # e.g. one GPU

On CUDA the ranks use NCCL; compare bf16 and fp32 by running the script once per precision.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.testing import RankPool

MiB = 1 << 20


def _one_mode(
    stage: int, precision: str, checkpointing: bool, steps: int, warmup: int, micro_batch: int
) -> dict:
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", shardwise.rank() % torch.cuda.device_count())
        if cuda
        else torch.device("cpu")
    )
    torch.manual_seed(0)
    cfg = GPTConfig.named("anchor")
    model = GPT(cfg).to(device)
    engine = shardwise.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
        shardwise.Config(
            zero_stage=stage,
            precision=precision,
            activation_checkpointing=["Block"] if checkpointing else None,
        ),
    )
    weights = {f.full.untyped_storage().data_ptr() for f in engine.flats}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(shardwise.rank())
    times, kept = [], 0
    for i in range(warmup + steps):
        t = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=g)
        t = t.to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if i == warmup:
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                loss = engine(t[:, :-1], t[:, 1:])
            kept = sum(saved.values())
        else:
            loss = engine(t[:, :-1], t[:, 1:])
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    mem = engine.memory()
    elem = torch.empty(0, dtype=engine.dtypes.param).element_size()
    return {
        "step_s": statistics.median(times),
        "kept": kept,
        "peak": peak,
        "block_input": micro_batch * cfg.seq_len * cfg.d_model * elem,
        "layers": cfg.n_layer,
        "state": mem["params"] + mem["grads"] + mem["optimizer"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    rows = {}
    for checkpointing in (False, True):
        pool = RankPool(args.world_size, pg_timeout_s=600)
        try:
            res = pool.run(
                _one_mode,
                args.stage,
                args.precision,
                checkpointing,
                args.steps,
                args.warmup,
                args.micro_batch,
                timeout_s=3600,
            )
        finally:
            pool.close()
        rows["checkpointed" if checkpointing else "plain"] = res[0]
    plain, ckpt = rows["plain"], rows["checkpointed"]
    # One block's activations come back while its backward runs: what the plain run keeps per
    # block, i.e. (plain - what both keep outside the blocks) / layers.
    outside = ckpt["kept"] - ckpt["layers"] * ckpt["block_input"]
    plain["recompute"] = 0
    ckpt["recompute"] = (plain["kept"] - outside) // ckpt["layers"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"\nGPT anchor (23.2M params), world size {args.world_size}, ZeRO stage {args.stage}, "
        f"{args.precision}, micro-batch {args.micro_batch}, {device}; medians of "
        f"{args.steps} steps\n"
    )
    print(
        "| mode | activations kept (MiB) | peak activations (MiB) | peak per rank (MiB) "
        "| model states (MiB) | step s |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['kept'] / MiB:.1f} | {(r['kept'] + r['recompute']) / MiB:.1f} | "
            f"{r['peak'] / MiB:.0f} | {r['state'] / MiB:.1f} | {r['step_s']:.3f} |"
        )
    print(
        f"\npeak activation memory with checkpointing: "
        f"{(ckpt['kept'] + ckpt['recompute']) / plain['kept']:.3f}x of plain; "
        f"recompute step-time cost: {ckpt['step_s'] / plain['step_s']:.3f}x"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()

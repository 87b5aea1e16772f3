"""Everything a CUDA machine can check, in one short run: the GPU tests, then bf16 against fp32
step time of the built-in GPT and its MFU.

    python benchmarks/gpu_check.py [--model gpt2] [--micro-batch 8] [--steps 10] [--json F]

1. ``pytest tests/gpu`` (NCCL collectives and the engine on NCCL, CUDA model-state bytes
   against the engine's report and the ZeRO formulas, GPU topology facts, bf16 matmul
   calibration, ``finetune --auto`` of the demo Llama on one GPU), its summary line printed.
2. One rank, ZeRO-0: median step (after 3 warm-ups) in fp32 and bf16, tokens/s, the bf16 speedup,
   and MFU = model FLOPs per step (``shardwise.costmodel``: 6 x parameters x tokens plus
   attention) / step time / the device's dense bf16 peak (the matching preset's).
3. The ``--auto`` loop on the GPU: ``shardwise plan --measure --devices 1 --run-top 3`` on the
   ``--auto-model`` (calibrated on NCCL, the best three layouts run), predicted against measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _pytest() -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else f"pytest exited {proc.returncode}"


def _auto_loop(model: str) -> str:
    cmd = [sys.executable, "-m", "shardwise.cli.main", "plan", "--measure", "--model", model,
           "--devices", "1", "--global-batch", "16", "--auto-budget-s", "20", "--run-top", "3",
           "--run-steps", "5"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    return (
        proc.stdout[-4000:] if proc.returncode == 0 else f"plan --measure exited {proc.returncode}"
    )


def _step_time(model_name: str, micro: int, steps: int, precision: str, port: int) -> dict:
    import shardwise
    from shardwise.models import GPT, GPTConfig

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    shardwise.init(backend="nccl")
    dev = shardwise.device()
    cfg = GPTConfig.named(model_name)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  shardwise.Config(precision=precision))  # fmt: skip
    x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), device=dev)
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    peak_mib = torch.cuda.max_memory_allocated(dev) / 2**20
    shardwise.shutdown()
    return {"step_s": statistics.median(times), "peak_allocated_mib": peak_mib}


def _in_child(*args: object) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_step_time, args)


def main() -> int:
    from shardwise.costmodel import Plan, hardware, predict, shape

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--auto-model", default="small", help="model of the --auto loop check")
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    name = torch.cuda.get_device_name(0)
    out: dict = {"device": name, "tests": _pytest()}
    preset = "h200x8-ib" if "H200" in name else "h100x8-ib" if "H100" in name else "a100x8-ib"
    hw = hardware(preset)
    flops = predict(shape(args.model), Plan(micro_batch=args.micro_batch), hw)
    tokens = args.micro_batch * shape(args.model).seq_len
    for i, precision in enumerate(("fp32", "bf16")):
        got = _in_child(args.model, args.micro_batch, args.steps, precision, 29540 + i)
        got["tokens_per_s"] = tokens / got["step_s"]
        got["mfu"] = flops.model_flops_per_step / got["step_s"] / hw.peak_flops
        out[precision] = got
    out["bf16_speedup"] = out["fp32"]["step_s"] / out["bf16"]["step_s"]
    print(f"{name}: {out['tests']}")
    for precision in ("fp32", "bf16"):
        r = out[precision]
        print(f"{args.model} {precision}: {r['step_s'] * 1e3:.1f} ms/step, "
              f"{r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%} of {preset}'s bf16 peak, "
              f"peak allocated {r['peak_allocated_mib']:,.0f} MiB")  # fmt: skip
    print(f"bf16 speedup over fp32: {out['bf16_speedup']:.2f}x")
    out["auto_loop"] = _auto_loop(args.auto_model)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

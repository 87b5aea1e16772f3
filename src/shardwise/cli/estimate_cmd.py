"""``shardwise estimate``: memory per rank under each ZeRO stage, before training anything.

shardwise estimate --params 7e9 --world-size 64 --precision bf16 --device-memory 80GB
shardwise estimate --model small --micro-batch 16 --world-size 2
"""

from __future__ import annotations

import argparse
import math
import re

from shardwise.estimate import (
    PRECISIONS,
    estimate_activations,
    estimate_model_states,
    format_bytes,
    format_estimate_table,
    parse_bytes,
)
from shardwise.models.gpt import MODEL_SIZES, GPTConfig
from shardwise.tp import estimate as tp_estimate

MAX_PARAMS = 10**15
"""Largest --params accepted (a thousand times the largest models trained)."""
MAX_WORLD = 10**7
MAX_TOKENS = 10**9
"""Largest micro-batch, sequence length, or their product, accepted."""

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A parameter count: ``7e9``, ``7B``, ``125M``, ``1.5b`` or ``42000``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?|\.\d+)\s*([kmbgtKMBGT]?)\s*", text)
    if m is None:
        raise ValueError(f"--params {text!r} is not a count: write e.g. 7e9, 7B or 125M")
    value = float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"--params must be at least 1, got {text!r}")
    if value > MAX_PARAMS:
        raise ValueError(f"--params {text} is beyond any model: at most {MAX_PARAMS:.0e}")
    return round(value)


def _check_sizes(args: argparse.Namespace) -> None:
    """Counts that cannot describe a real run are refused before any arithmetic."""
    for flag, value, high in (
        ("--world-size", args.world_size, MAX_WORLD),
        ("--micro-batch", args.micro_batch, MAX_TOKENS),
        ("--seq-len", args.seq_len, MAX_TOKENS),
    ):
        if value is not None and not 1 <= value <= high:
            raise ValueError(f"{flag} must be in 1..{high:,}, got {value}")
    if args.seq_len is not None and args.micro_batch * args.seq_len > MAX_TOKENS:
        raise ValueError(
            f"--micro-batch {args.micro_batch} x --seq-len {args.seq_len} tokens is more than "
            f"{MAX_TOKENS:,} per micro-batch"
        )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="memory per rank under each ZeRO stage",
        description="Estimate params, grads and optimizer bytes per rank for "
        "ZeRO stages 0-3 (Adam(W)); with --model also activation "
        "memory with and without activation checkpointing.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="parameter count, e.g. 7e9 or 125M")
    what.add_argument("--model", help=f"a model preset: {' | '.join(MODEL_SIZES)}")
    p.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="data-parallel ranks sharding the states (default 2)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        help=f"{' | '.join(PRECISIONS)} (default fp32; bf16/fp16 keep fp32 masters)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=list(PRECISIONS),
        default=None,
        help="dtype gradients are reduced and sharded gradients kept in "
        "(default fp32, as the engine)",
    )
    p.add_argument(
        "--offload", action="store_true", help="optimizer states and master weights in host memory"
    )
    p.add_argument(
        "--device-memory", help="memory per device, e.g. 80GB or 24GiB: adds a 'fits' column"
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=16,
        help="with --model: sequences per rank per micro-step (default 16)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="with --model: tokens per sequence (default: the model's context length)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="with --model: tensor-parallel degree (the world is dp x tp; ZeRO over dp)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: activations under sequence parallelism",
    )
    p.set_defaults(func=run_estimate)


def _tp_activation_lines(cfg: GPTConfig, args: argparse.Namespace, seq_len: int) -> str:
    """Korthikanti et al. 2022's per-layer activation formulas (16-bit), times n_layer."""
    rows = []
    for recompute in tp_estimate.RECOMPUTE:
        got = tp_estimate.gpt_activation_bytes(
            cfg, args.micro_batch, seq_len, args.tp, args.sequence_parallel, recompute
        )
        rows.append(f"  recompute {recompute:>9}: {format_bytes(got)}")
    mode = "tp + sequence parallel" if args.sequence_parallel else "tp"
    head = f"transformer-layer activations per rank, {mode}={args.tp} (Korthikanti et al., 16-bit)"
    return "\n".join([head, *rows])


def _peak_table(states: dict[int, int], act: int, act_ckpt: int, device: int | None) -> str:
    header = ["stage", "model states", "peak", "peak (act. ckpt)"]
    if device is not None:
        header.append(f"fits {format_bytes(device)}")
    rows = [header]
    for stage, s in sorted(states.items()):
        row = [str(stage), format_bytes(s), format_bytes(s + act), format_bytes(s + act_ckpt)]
        if device is not None:
            fits = ["yes" if s + act <= device else "no", "yes" if s + act_ckpt <= device else "no"]
            row.append(" / ".join(fits) + " (plain / ckpt)")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def run_estimate(args: argparse.Namespace) -> int:
    _check_sizes(args)
    if args.precision not in PRECISIONS:
        raise ValueError(
            f"--precision must be one of {', '.join(PRECISIONS)}, got {args.precision!r}"
        )
    device = parse_bytes(args.device_memory) if args.device_memory else None
    cfg: GPTConfig | None = None
    if args.model is not None:
        if args.model not in MODEL_SIZES:
            raise ValueError(
                f"--model {args.model!r} is unknown: choose one of {', '.join(MODEL_SIZES)}"
            )
        cfg = GPTConfig.named(args.model)
        num_params = cfg.param_count()
    else:
        num_params = parse_count(args.params)
    dp, held = args.world_size, num_params
    if args.tp != 1:
        if cfg is None or args.tp < 1 or args.world_size % args.tp:
            raise ValueError(
                f"--tp {args.tp} needs --model and must divide --world-size {args.world_size}"
            )
        sharded, replicated = tp_estimate.gpt_params_per_rank(cfg, args.tp)
        held, dp = sharded + replicated, args.world_size // args.tp
    estimates = estimate_model_states(
        held, dp, args.precision, args.offload, reduce_dtype=args.reduce_dtype
    )
    name = f"{args.model} model, " if cfg else ""
    print(
        f"{name}{num_params:,} parameters, {args.world_size} ranks, {args.precision}"
        f"{', optimizer offloaded to host' if args.offload else ''}; Adam(W) states"
    )
    print()
    print("model states per rank")
    print(format_estimate_table(estimates, device if cfg is None else None))
    if cfg is not None:
        seq_len = args.seq_len or cfg.seq_len
        act = estimate_activations(cfg, args.micro_batch, seq_len, args.precision)
        act_ckpt = estimate_activations(
            cfg, args.micro_batch, seq_len, args.precision, checkpointing=True
        )
        print()
        print(
            f"activations per rank (micro-batch {args.micro_batch} x {seq_len} tokens): "
            f"{format_bytes(act)}; with activation checkpointing: {format_bytes(act_ckpt)}"
        )
        if args.tp != 1:
            print(f"(per rank: {held:,} parameters at tp={args.tp}, then ZeRO over dp={dp})")
            print(_tp_activation_lines(cfg, args, seq_len))
        print()
        print("peak per rank on the device (model states + activations)")
        print(_peak_table({s: e.device_bytes for s, e in estimates.items()}, act, act_ckpt, device))
    return 0

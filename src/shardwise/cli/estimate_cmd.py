"""``shardwise estimate``: memory per rank under each ZeRO stage, before training anything.

shardwise estimate --params 7e9 --world-size 64 --precision bf16 --device-memory 80GB
shardwise estimate --model small --micro-batch 16 --world-size 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from shardwise.costmodel import pipeline_memory as pp_estimate
from shardwise.costmodel import tp_memory as tp_estimate
from shardwise.costmodel.context import cp_bytes_per_layer
from shardwise.costmodel.plan import Plan
from shardwise.costmodel.shapes import gpt_shape
from shardwise.estimate import (
    PRECISIONS,
    estimate_activations,
    estimate_model_states,
    format_bytes,
    format_estimate_table,
    format_init_peak_table,
    parse_bytes,
)
from shardwise.models.gpt import MODEL_SIZES, GPTConfig
from shardwise.parallel.layout import ESTIMATE_FLAGS, Layout, check_layout, gpt_dims
from shardwise.parallel.pipeline.schedule import SCHEDULES

MAX_PARAMS = 10**15
"""Largest --params accepted (a thousand times the largest models trained)."""
MAX_TOKENS = 10**9
"""Largest micro-batch, sequence length, or their product, accepted."""

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str, flag: str = "--params", high: int = MAX_PARAMS) -> int:
    """A count: ``7e9``, ``7B``, ``125M``, ``1.5b`` or ``42000``, a whole number in 1..high;
    ``ValueError`` naming ``flag`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?|\.\d+)\s*([kmbgtKMBGT]?)\s*", text)
    if m is None:
        raise ValueError(f"{flag} {text!r} is not a count: write e.g. 7e9, 7B or 125M")
    value = float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or not 1 <= value <= high or not value.is_integer():
        raise ValueError(f"{flag} must be a whole number in 1..{high:,}, got {text!r}")
    return round(value)


def _check_sizes(args: argparse.Namespace) -> None:
    """Counts that cannot describe a real run are refused before any arithmetic."""
    for flag, value, high in (
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
        "memory with and without activation checkpointing. The layout (--world-size, --tp, "
        "--pp, --microbatches, ...) is checked as train checks it; at most 1,048,576 ranks, "
        "4,096 micro-batches, 16,384 simulated stage micro-batches.",
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
        help="with --model: sequences per rank per micro-step; under --pp split into "
        "--microbatches pipeline micro-batches (default 16)",
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
        "--cp",
        type=int,
        default=1,
        help="with --model: context-parallel degree, ranks splitting each sequence (the world "
        "is dp x cp x tp x pp; ZeRO over dp x cp; activations and cp bytes per rank)",
    )
    p.add_argument(
        "--cp-method",
        default="ring",
        help="with --cp: ring | all_to_all (default ring)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: activations under sequence parallelism",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="with --model: pipeline stages (the world is dp x tp x pp; ZeRO over dp)",
    )
    p.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        default=None,
        help="with --pp: the pipeline schedule (default 1f1b)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="with --pp: pipeline micro-batches --micro-batch splits into, as in train "
        "(default: --pp)",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        help="with --schedule interleaved_1f1b: model chunks per rank (default 1)",
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


def _cp_words(layout: Layout) -> str:
    return f" cp {layout.cp} ({layout.cp_method}) x" if layout.cp > 1 else ""


def _cp_lines(cfg: GPTConfig, args: argparse.Namespace, layout: Layout, micro_batch: int) -> str:
    """What context parallelism keeps and sends per rank (``costmodel.context``)."""
    if layout.cp == 1:
        return ""
    seq_len = args.seq_len or cfg.seq_len
    shape = dataclasses.replace(gpt_shape(args.model, cfg), seq_len=seq_len)
    plan = Plan(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                cp_method=layout.cp_method, micro_batch=micro_batch,
                precision=args.precision)  # fmt: skip
    per_layer = cp_bytes_per_layer(shape, plan)
    return (
        f"context parallel cp={layout.cp} ({layout.cp_method}): each rank keeps "
        f"{seq_len // layout.cp} of the {seq_len} tokens of a sequence (activations 1/cp); "
        f"it sends {format_bytes(int(per_layer))} per layer and micro-batch of {micro_batch} "
        f"over cp, {format_bytes(int(per_layer * cfg.n_layer))} through the {cfg.n_layer} "
        "layers (forward and backward, no recompute)"
    )


def _peak_table(peaks: dict[int, tuple[int, int, int]], device: int | None) -> str:
    """Per ZeRO stage: (model states, peak, peak with activation checkpointing) bytes."""
    header = ["stage", "model states", "peak", "peak (act. ckpt)"]
    if device is not None:
        header.append(f"fits {format_bytes(device)}")
    rows = [header]
    for stage, (s, plain, ckpt) in sorted(peaks.items()):
        row = [str(stage), format_bytes(s), format_bytes(plain), format_bytes(ckpt)]
        if device is not None:
            fits = ["yes" if plain <= device else "no", "yes" if ckpt <= device else "no"]
            row.append(" / ".join(fits) + " (plain / ckpt)")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _model(args: argparse.Namespace) -> tuple[GPTConfig | None, int]:
    """The --model preset (None with --params) and the parameter count."""
    if args.model is None:
        return None, parse_count(args.params)
    if args.model not in MODEL_SIZES:
        raise ValueError(
            f"--model {args.model!r} is unknown: choose one of {', '.join(MODEL_SIZES)}"
        )
    cfg = GPTConfig.named(args.model)
    return cfg, cfg.param_count()


def _check_layout(args: argparse.Namespace, cfg: GPTConfig | None) -> Layout:
    """The layout the flags describe, checked as ``train`` checks it (``--micro-batch`` splits
    into ``--microbatches`` pipeline micro-batches there too); tp, pp and sequence
    parallelism need ``--model``."""
    if cfg is None:
        for flag, given in (
            ("--tp", args.tp != 1),
            ("--pp", args.pp != 1),
            ("--cp", args.cp != 1),
            ("--sequence-parallel", args.sequence_parallel),
        ):
            if given:
                raise ValueError(f"{flag} splits a model's layers: give --model, not --params")
    layout = Layout(
        world_size=args.world_size,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        cp_method=args.cp_method,
        sequence_parallel=args.sequence_parallel,
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
    )
    dims = None if cfg is None else gpt_dims(args.model, cfg, args.seq_len)
    check_layout(layout, model=dims, micro_batch=args.micro_batch, flags=ESTIMATE_FLAGS)
    return layout


def _pipeline_table(ranks: list[pp_estimate.PipelineRankEstimate]) -> str:
    header = ["pp rank", "blocks", "parameters", "in flight", *tp_estimate.RECOMPUTE]
    rows = [header]
    for r in ranks:
        act = [format_bytes(r.activation_bytes[mode]) for mode in tp_estimate.RECOMPUTE]
        rows.append([str(r.pp_rank), str(r.blocks), f"{r.params:,}", str(r.in_flight), *act])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def _run_pipeline(
    args: argparse.Namespace, cfg: GPTConfig, layout: Layout, num_params: int, device: int | None
) -> int:
    dp, m = layout.dp * layout.cp, layout.pipeline_microbatches  # ZeRO over dp x cp
    seq_len = args.seq_len or cfg.seq_len
    schedule = args.schedule or "1f1b"
    per_micro = args.micro_batch // m  # --micro-batch splits into m pipeline micro-batches
    ranks = pp_estimate.gpt_pipeline_estimate(
        cfg,
        args.pp,
        schedule,
        m,
        per_micro,
        seq_len,
        virtual_stages=args.virtual_stages,
        tp=args.tp,
        sequence_parallel=args.sequence_parallel,
    )
    if layout.cp > 1:  # each cp rank keeps 1/cp of every sequence's activations
        ranks = [
            dataclasses.replace(r, activation_bytes={k: v // layout.cp for k, v in
                                                     r.activation_bytes.items()})
            for r in ranks
        ]  # fmt: skip
    states = [
        estimate_model_states(r.params, dp, args.precision, args.offload, args.reduce_dtype)
        for r in ranks
    ]
    heaviest = max(range(args.pp), key=lambda i: ranks[i].params)
    print(
        f"{args.model} model, {num_params:,} parameters, {args.world_size} ranks = dp "
        f"{layout.dp} x{_cp_words(layout)} tp {args.tp} x pp {args.pp}, {args.precision}"
        f"{', optimizer offloaded to host' if args.offload else ''}; Adam(W) states"
    )
    print()
    mode = f", tp={args.tp}" + (" + sequence parallel" if args.sequence_parallel else "")
    print(
        f"pipeline {schedule}, {m} micro-batches of {per_micro} x {seq_len} tokens "
        f"(--micro-batch {args.micro_batch} split {m} ways), "
        f"{args.virtual_stages} virtual stage(s){mode}: parameters per rank and peak "
        "transformer-layer activations by recompute (Korthikanti et al., 16-bit)"
    )
    print(_pipeline_table(ranks))
    print()
    if layout.cp > 1:
        print(_cp_lines(cfg, args, layout, per_micro))
        print()
    print(f"model states per rank (pp rank {heaviest}, the most parameters; ZeRO over {dp} ranks)")
    print(format_estimate_table(states[heaviest], None))
    print()
    print(format_init_peak_table(states[heaviest], num_params, cfg, args.tp))
    print()
    print("peak per rank on the device (the largest over pp ranks; ckpt: full recompute)")
    peaks = {
        stage: (
            max(s[stage].device_bytes for s in states),
            max(s[stage].device_bytes + r.activation_bytes["none"] for s, r in zip(states, ranks)),
            max(s[stage].device_bytes + r.activation_bytes["full"] for s, r in zip(states, ranks)),
        )
        for stage in states[0]
    }
    print(_peak_table(peaks, device))
    return 0


def run_estimate(args: argparse.Namespace) -> int:
    _check_sizes(args)
    if args.precision not in PRECISIONS:
        raise ValueError(
            f"--precision must be one of {', '.join(PRECISIONS)}, got {args.precision!r}"
        )
    device = parse_bytes(args.device_memory) if args.device_memory else None
    cfg, num_params = _model(args)
    layout = _check_layout(args, cfg)
    if args.pp != 1:
        assert cfg is not None  # _check_layout refuses --pp without --model
        return _run_pipeline(args, cfg, layout, num_params, device)
    dp, held = args.world_size, num_params
    if args.tp != 1:
        assert cfg is not None  # _check_layout refuses --tp without --model
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
    print()
    print(format_init_peak_table(estimates, num_params, cfg, args.tp))
    if cfg is not None:
        seq_len = (args.seq_len or cfg.seq_len) // layout.cp  # this cp rank's tokens
        act = estimate_activations(cfg, args.micro_batch, seq_len, args.precision)
        act_ckpt = estimate_activations(
            cfg, args.micro_batch, seq_len, args.precision, checkpointing=True
        )
        print()
        print(
            f"activations per rank (micro-batch {args.micro_batch} x {seq_len} tokens): "
            f"{format_bytes(act)}; with activation checkpointing: {format_bytes(act_ckpt)}"
        )
        if layout.cp != 1:
            print(_cp_lines(cfg, args, layout, args.micro_batch))
        if args.tp != 1:
            over = f"dp x cp={dp}" if layout.cp > 1 else f"dp={dp}"
            print(f"(per rank: {held:,} parameters at tp={args.tp}, then ZeRO over {over})")
            print(_tp_activation_lines(cfg, args, seq_len))
        print()
        print("peak per rank on the device (model states + activations)")
        peaks = {
            s: (e.device_bytes, e.device_bytes + act, e.device_bytes + act_ckpt)
            for s, e in estimates.items()
        }
        print(_peak_table(peaks, device))
    return 0

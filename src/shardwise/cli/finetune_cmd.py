"""``shardwise finetune MODEL_DIR --data FILE``: fine-tune a local Hugging Face causal LM on
ranks, with ``shardwise train``'s options, run directory and launcher.

Everything that can be wrong is found here before a rank starts (the model directory, the
tokenizer, every data record, the LoRA targets, conflicting options): one line, exit code 2,
nothing written to the run directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardwise.cli import train_auto, train_cmd
from shardwise.cli.launch import check_launch_args
from shardwise.cli.run_args import add_run_args
from shardwise.train.options import RunConfig, TrainOptions
from shardwise.train.rundir import RunDir, new_run_dir

DEFAULT_STEPS = 100
DEFAULT_LR = 1e-4
SHARED_TRAIN_FLAGS = (
    "steps",
    "seq_len",
    "lr",
    "warmup_steps",
    "eval_every",
    "eval_batches",
    "log_every",
    "tp",
    "dp_replicate",
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a local Hugging Face causal LM (LoRA or full) across ranks",
        description="Fine-tune a local Hugging Face causal LM directory (config, safetensors, "
        "tokenizer; nothing downloaded) on JSONL records with text, prompt + completion, or "
        "messages. Same run directory, checkpoints, resume and launcher as shardwise train; "
        "writes adapter/ (LoRA) and / or model/ at the end.",
    )
    groups = add_run_args(p, default_nproc=2, default_steps=DEFAULT_STEPS, default_lr=DEFAULT_LR)
    # the train command's options a fine-tuning run does not take
    p.set_defaults(
        func=run_finetune,
        model=None,
        max_bytes=None,
        sequence_parallel=None,
        pp=None,
        schedule=None,
        microbatches=None,
    )
    p.add_argument("model_dir", nargs="?", type=Path, help="Hugging Face model directory")
    d = p.add_argument_group("fine-tuning")
    d.add_argument("--data", help="training records: .jsonl (or a .json list)")
    d.add_argument("--eval-data", help="validation records, same shapes")
    d.add_argument("--lora", help="LoRA: r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj")
    d.add_argument("--full", action="store_true", help="fine-tune every weight")
    d.add_argument("--merge", action="store_true", help="with --lora: also write model/ merged")
    d.add_argument("--packing", action="store_true", help="pack examples into --seq-len rows")
    d.add_argument("--train-on-prompt", action="store_true", help="loss on prompts too")
    d.add_argument("--skip-bad-lines", action="store_true", help="skip malformed records")
    d.add_argument(
        "--demo",
        type=Path,
        metavar="DIR",
        help="write a tiny Llama, its tokenizer and an instruction dataset into DIR, then "
        "fine-tune it (LoRA unless --full; run directory DIR/run)",
    )
    train_auto.add_auto_args(p)
    del groups


def _demo(args: argparse.Namespace) -> None:
    """``--demo DIR``: write the demo model and data, and point the run at them."""
    from shardwise.sft import demo

    if args.model_dir is not None or args.data is not None:
        raise ValueError("--demo brings its own model and data: leave MODEL_DIR and --data out")
    args.model_dir, data = demo.write_demo(args.demo)
    args.data = str(data)
    if not args.lora and not args.full:
        args.lora = demo.DEMO_LORA
    args.run_dir = args.run_dir or args.demo / "run"
    args.seq_len = args.seq_len or 64
    args.steps = args.steps or 20


def _finetune_options(args: argparse.Namespace) -> Any:
    from shardwise.sft.options import FinetuneOptions

    if args.model_dir is None:
        raise ValueError("shardwise finetune needs MODEL_DIR, a Hugging Face model directory")
    if args.data is None:
        raise ValueError("--data is required: a .jsonl file of text, prompt/completion or messages")
    if bool(args.lora) == bool(args.full):
        raise ValueError("choose one of --lora r=...,targets=... or --full")
    return FinetuneOptions(
        model_dir=str(args.model_dir.resolve()),
        eval_data=str(Path(args.eval_data).resolve()) if args.eval_data else None,
        lora=args.lora,
        packing=args.packing,
        train_on_prompt=args.train_on_prompt,
        skip_bad_lines=args.skip_bad_lines,
        merge=args.merge,
    )


def _check_inputs(ft: Any, data: str, seq_len: int | None, tp: int) -> tuple[int, list[str]]:
    """Read and check the model directory (its weights' headers against the model's names,
    shapes and dtypes), tokenizer, data and LoRA targets as the ranks will, before anything is
    written; returns the sequence length and the decoder layer classes."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardwise.sft.lora import check_targets
    from shardwise.sft.model import check_model_dir, decoder_layer_classes, load_tokenizer
    from shardwise.sft.options import DEFAULT_SEQ_LEN
    from shardwise.sft.pipeline import load_training_data
    from shardwise.sft.setup import check_base_weights, check_lora_under_tp, tp_plan_of

    config = check_model_dir(Path(ft.model_dir))
    context = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
    if seq_len is not None and seq_len > context:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens")
    seq_len = seq_len or min(DEFAULT_SEQ_LEN, context)
    tok = load_tokenizer(Path(ft.model_dir))
    kw = {"seq_len": seq_len, "packing": ft.packing, "train_on_prompt": ft.train_on_prompt}
    report = load_training_data(data, tok, skip_bad_lines=ft.skip_bad_lines, **kw).report()
    print(f"shardwise finetune: {data}: {report}")
    if ft.eval_data is not None:
        load_training_data(ft.eval_data, tok, **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_base_weights(model, Path(ft.model_dir))
    if ft.lora_spec is not None:
        check_targets(model, ft.lora_spec)
        if tp > 1:
            check_lora_under_tp(model, ft.lora_spec, tp_plan_of(config, tp))
    return seq_len, decoder_layer_classes(model)


def _new_run(args: argparse.Namespace) -> tuple[RunConfig, RunDir, dict[str, Any] | None]:
    """The new run, its directory and, under ``--auto``, the record of the layout chosen."""
    ft = _finetune_options(args)
    run_dir = RunDir(args.run_dir) if args.run_dir else new_run_dir()
    if run_dir.exists():
        raise ValueError(f"{run_dir.root} already holds a run: pass --resume or another --run-dir")
    args.nproc_per_node = args.nproc_per_node or 2
    check_launch_args(args)
    if not Path(args.data).is_file():
        raise ValueError(f"--data {args.data} does not exist")
    data = str(Path(args.data).resolve())
    seq_len, blocks = _check_inputs(ft, data, args.seq_len, args.tp or 1)
    given = {k: v for k, v in vars(args).items() if k in SHARED_TRAIN_FLAGS and v is not None}
    given.update(seq_len=seq_len, data=data)
    given.setdefault("steps", DEFAULT_STEPS)
    given.setdefault("lr", DEFAULT_LR)
    opts = TrainOptions(weight_decay=0.0, **given)
    engine = train_cmd._engine_config(args, run_dir).replace(wrap_policy=blocks)
    # LoRA: checkpoints hold the adapters (and their optimizer states); the frozen base is read
    # from MODEL_DIR again on resume
    engine = engine.replace(checkpoint_frozen=ft.lora is None)
    if args.activation_checkpointing:
        engine = engine.replace(activation_checkpointing=blocks)
    run = RunConfig(
        train=opts,
        engine=engine,
        world_size=args.nproc_per_node * args.nnodes,
        launch={"nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes},
        finetune=ft.to_dict(),
    )
    if run.world_size % (opts.tp * opts.dp_replicate):
        raise ValueError(
            f"--tp {opts.tp} x --dp-replicate {opts.dp_replicate} must divide the "
            f"{run.world_size} ranks"
        )
    if not args.auto:
        return run, run_dir, None
    from shardwise.train.finetune_auto import finetune_target

    target, checks = finetune_target(Path(ft.model_dir), ft.lora_spec, seq_len)
    run, plan = train_auto.plan_run(args, run, target, checks, "finetune")
    return run, run_dir, plan


def run_finetune(args: argparse.Namespace) -> int:
    train_cmd._check_engine_flags(args)
    if args.resume:
        given = [
            f for f in ("lora", "full", "merge", "packing", "data", "demo") if getattr(args, f)
        ]
        if given:
            raise ValueError(f"--{given[0]} cannot change when resuming: the run keeps its own")
        if args.auto:
            raise ValueError("--auto chooses a new run's layout: a resumed run keeps its own")
        run, run_dir = train_cmd._resumed_run(args)
        plan = None
        if run.finetune is None:
            raise ValueError(f"{run_dir.root} is a shardwise train run: resume it with train")
    else:
        if args.demo is not None:
            _demo(args)
        run, run_dir, plan = _new_run(args)
    ft = run.finetune or {}
    how = f"LoRA {ft.get('lora')}" if ft.get("lora") else "full"
    headline = (
        f"shardwise finetune: {Path(ft.get('model_dir', '?')).name} ({how}), {run.world_size} "
        f"ranks ({run.layout()}), ZeRO-{run.engine.zero_stage}, {run.engine.precision}, "
        f"{run.train.steps} steps of {run.global_batch_size} sequences"
    )
    written = None if plan is None else (lambda: train_auto.write_plan(plan, run_dir.root))
    return train_cmd.launch_run(args, run, run_dir, "finetune", headline, written)


def finetune(model_dir: str | Path, data: str | Path, **options: Any) -> Path:
    """Fine-tune as ``shardwise finetune MODEL_DIR --data DATA`` does, from Python: each
    keyword is the command's option (``lora="r=8,targets=q_proj,v_proj"``, ``steps=20``,
    ``packing=True``, ``run_dir=...``; True for a flag, None or False to leave it out).
    Launches the ranks and waits for them. Returns the run directory.

    Raises:
        ValueError: bad input (the command's one-line message), or the run failing.
    """
    from shardwise.cli.main import build_parser

    argv = ["finetune", str(model_dir), "--data", str(data)]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        raise ValueError(f"shardwise finetune does not take these options: {options}") from None
    if args.run_dir is None:
        args.run_dir = new_run_dir().root
    code = run_finetune(args)
    if code != 0:
        raise ValueError(f"the fine-tuning run in {args.run_dir} failed (exit code {code})")
    return Path(args.run_dir)

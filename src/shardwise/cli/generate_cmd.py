"""``shardwise generate RUN_DIR_OR_MODEL_DIR --prompt TEXT [--chat]``: sample text from a
``shardwise train`` run, a ``shardwise finetune`` run or a Hugging Face model directory (these
two with their tokenizer and the model's generation config)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MAX_TOKENS = 100_000
"""Most bytes one ``generate`` produces (one forward pass each, on the CPU)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a run's newest weights or a Hugging Face model directory",
        description="Continue a prompt with the newest weights of a shardwise train run (its "
        "last checkpoint or final model file), of a shardwise finetune run (model/, adapter/ "
        "or its last checkpoint) or of a Hugging Face model directory.",
    )
    p.add_argument("run_dir", type=Path, help="a run directory or a Hugging Face model directory")
    p.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help=f"tokens (bytes for a train run) to generate (default 200, Hugging Face models "
        f"64; at most {MAX_TOKENS:,})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature; 0 is greedy (default 0.8; Hugging Face models: their "
        "generation config)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sample among the k likeliest tokens (default 40; Hugging Face models: their "
        "generation config)",
    )
    p.add_argument(
        "--chat", action="store_true", help="the prompt is a user turn (the chat template)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(func=run_generate)


def _run_hf(args: argparse.Namespace) -> int:
    from shardwise.sft import generate

    loaded = generate.load(args.run_dir)
    text = generate.generate(
        loaded,
        args.prompt,
        chat=args.chat,
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(f"# weights from {loaded.source}", file=sys.stderr)
    print(text if args.chat else args.prompt + text)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from shardwise.sft.generate import finetune_options, is_model_dir
    from shardwise.train.sampling import sample

    if args.tokens is not None and args.tokens > MAX_TOKENS:
        raise ValueError(
            f"--tokens {args.tokens} is more than {MAX_TOKENS:,}: generate in pieces "
            "(each piece continues the last one's text as its --prompt)"
        )
    if finetune_options(args.run_dir) is not None or is_model_dir(args.run_dir):
        return _run_hf(args)
    if args.chat:
        raise ValueError(
            f"--chat needs a fine-tuning run or a model directory; {args.run_dir} is neither"
        )

    out = sample(
        args.run_dir,
        args.prompt,
        tokens=200 if args.tokens is None else args.tokens,
        temperature=0.8 if args.temperature is None else args.temperature,
        top_k=40 if args.top_k is None else args.top_k,
        seed=args.seed,
    )
    print(f"# weights of step {out.step} from {out.source}", file=sys.stderr)
    print(out.prompt + out.continuation)
    return 0

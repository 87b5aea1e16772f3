"""``shardwise generate RUN_DIR --prompt TEXT``: sample text from a trained run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MAX_TOKENS = 100_000
"""Most bytes one ``generate`` produces (one forward pass each, on the CPU)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a trained run's newest weights",
        description="Continue a prompt with the newest weights of a shardwise "
        "train run (its last checkpoint or final model file).",
    )
    p.add_argument("run_dir", type=Path, help="the run directory (holds config.json)")
    p.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    p.add_argument(
        "--tokens",
        type=int,
        default=200,
        help=f"bytes to generate (default 200, at most {MAX_TOKENS:,})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 is greedy (default 0.8)",
    )
    p.add_argument(
        "--top-k", type=int, default=40, help="sample among the k likeliest bytes (default 40)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from shardwise.train.sampling import sample

    if args.tokens > MAX_TOKENS:
        raise ValueError(
            f"--tokens {args.tokens} is more than {MAX_TOKENS:,}: generate in pieces "
            "(each piece continues the last one's text as its --prompt)"
        )

    out = sample(
        args.run_dir,
        args.prompt,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(f"# weights of step {out.step} from {out.source}", file=sys.stderr)
    print(out.prompt + out.continuation)
    return 0

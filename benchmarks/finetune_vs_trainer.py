"""Fine-tuning a Hugging Face Llama: shardwise beside the Hugging Face ``Trainer`` over
DeepSpeed ZeRO-3 (through accelerate) and over DDP, LoRA and full fine-tuning.

    python benchmarks/finetune_vs_trainer.py [--model-size base] [--modes lora,full]
        [--systems sw3,sw0,ds3,ddp] [--steps 6] [--warmup 2] [--rounds 3] [--seq-len 256]
        [--vocab 8192] [--deepspeed-python /work/dsvenv/bin/python] [--json out.json]
        [--profile steps|startup]

One problem for every system: a Llama built from a config (``--model-size``: ``base`` 33.7 M
parameters, ``medium`` 16.9 M, ``small`` 7.4 M for a quick check; ``--vocab`` rows, of which
the offline BPE tokenizer ``shardwise.sft.demo.tokenizer`` uses the first 320), saved with
``save_pretrained`` into a temporary directory; a prompt/completion JSONL written here,
rendered by ``shardwise.sft`` (labels -100 on the prompt: loss on completions only), no
packing; 2 ranks on gloo, one thread each, ``--micro`` examples per rank (global batch 2 x
micro), padded to the longest in the micro-batch; AdamW (lr 1e-4, weight decay 0, constant),
fp32, no gradient clipping; LoRA r=16, alpha 32, no dropout on q, k, v, o (the adapters start
from the same values in every system).

Systems, each a fresh pair of processes launched here (torchrun's environment variables):
``swN`` shardwise ZeRO-N (``build_finetune_model`` on the meta device, streamed load,
``micro_losses``, ``engine.step``: the ``shardwise finetune`` step); ``dsN`` ``Trainer`` with
DeepSpeed ZeRO-N (``TrainingArguments(deepspeed=...)`` before ``from_pretrained``, so ZeRO-3
partitions the load; run by ``--deepspeed-python``, a virtual environment that has deepspeed);
``ddp`` ``Trainer`` over DDP (gloo, ``ddp_find_unused_parameters=False``, AdamW as
``optim="adamw_torch"``: the same optimizer, not the fused default). ZeRO-0 holds what DDP
holds, ZeRO-3 what DeepSpeed ZeRO-3 shards. The systems take turns for ``--rounds`` rounds
(order reversed every other round).

Per system: the median step (slowest rank; a step is the wall clock between the ends of
consecutive optimizer steps: the whole loop) and the process CPU time per step (all threads;
on a shared machine less inflated by other tenants than the wall clock), rank 0's split of a
step (batch and loop work / forward and backward / optimizer step; DeepSpeed steps inside
its backward), peak RSS of each rank (``ru_maxrss``: the lifetime peak, loading included) and
the peak before the first forward (loading and set-up), model state per rank (parameters,
gradients, optimizer state, DeepSpeed's flat fp32 master and partitions) before an extra,
untimed last step, seconds from process start to the first step's end, and the losses (the
first step's must agree between systems: the same problem). ``--profile steps`` prints rank
0's ops over the timed steps (torch.profiler), ``--profile startup`` its whole run under
cProfile (the times are then not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import source_version
from rank_launch import start_ranks

HERE = Path(__file__).resolve().parent
WORLD = 2
MiB = 1 << 20
SYSTEMS = {
    "sw0": "shardwise ZeRO-0",
    "sw2": "shardwise ZeRO-2",
    "sw3": "shardwise ZeRO-3",
    "ds3": "Trainer + DeepSpeed ZeRO-3",
    "ds2": "Trainer + DeepSpeed ZeRO-2",
    "ddp": "Trainer + DDP",
}
SIZES = {  # hidden, intermediate, layers, heads
    "small": (256, 688, 4, 4),
    "medium": (384, 1024, 6, 6),
    "base": (512, 1376, 8, 8),
}
PAIRS = (("ds3", "sw3"), ("ds2", "sw2"), ("ddp", "sw0"), ("ddp", "sw3"))
"""Each anchor beside the shardwise system holding the same state (and DDP beside ZeRO-3)."""
LORA = "r=16,alpha=32,dropout=0.0,targets=q_proj,k_proj,v_proj,o_proj"
LR = 1e-4


def write_model(root: Path, size: str, vocab: int) -> tuple[Path, dict[str, int]]:
    """The Llama of ``size`` with ``vocab`` embedding rows (the demo tokenizer uses the first
    ones; a real vocabulary's size puts real logits on the loss) and the demo tokenizer, saved;
    its parameter counts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.sft import demo
    from shardwise.sft.lora import LoraSpec, apply_lora

    hidden, inter, layers, heads = SIZES[size]
    tok = demo.tokenizer()
    cfg = LlamaConfig(
        vocab_size=max(vocab, len(tok)),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = root / "model"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    counts = {"full": sum(p.numel() for p in model.parameters())}
    lora = apply_lora(model, LoraSpec.parse(LORA))
    counts["lora"] = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    return out, counts


def write_data(path: Path, count: int) -> Path:
    """``count`` prompt/completion records, prompts of 30-69 words, completions of 15-44."""
    from shardwise.sft import demo

    records = [
        {
            "prompt": f"Q: {demo.sentence(i, 30 + (i * 7) % 40)}? A:",
            "completion": " " + demo.sentence(i + 11, 15 + (i * 5) % 30),
        }
        for i in range(count)
    ]
    return demo.write_jsonl(path, records)


def launch(python: str, spec: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Both ranks of one system as fresh processes; their results."""
    with tempfile.TemporaryDirectory(prefix="ft_bench_") as tmp:
        spec = {**spec, "out": tmp}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        script = HERE / "finetune_ranks.py"
        procs = start_ranks(
            python, script, spec_path, Path(tmp), WORLD, TOKENIZERS_PARALLELISM="false"
        )
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc, log in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
            log.close()
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outs = [Path(tmp) / f"rank{r}.json" for r in range(WORLD)]
        if not all(o.is_file() for o in outs):
            tails = [(Path(tmp) / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD)]
            raise RuntimeError(f"{spec['system']} ({spec['mode']}) exit codes {codes}:\n{tails[0]}")
        if any(c != 0 for c in codes):  # after its results were written: said, not hidden
            print(f"{spec['system']} ({spec['mode']}): ranks exited {codes} after writing results")
        return [json.loads(o.read_text()) for o in outs]


def summarize(key: str, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over every timed step of every round (a step: its slowest rank)."""
    steps = [max(t) for ranks in rounds for t in zip(*(r["times"] for r in ranks))]
    last = rounds[-1]
    losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in last))]
    return {
        "key": key,
        "step_s": statistics.median(steps),
        "step_s_all": steps,
        "cpu_s": statistics.median(
            max(c) for ranks in rounds for c in zip(*(r["cpu_times"] for r in ranks))
        ),
        "round_medians_s": [
            statistics.median(max(t) for t in zip(*(r["times"] for r in ranks))) for ranks in rounds
        ],
        "maxrss_mib": [max(rd[i]["maxrss_mib"] for rd in rounds) for i in range(WORLD)],
        "load_peak_mib": max(r["load_peak_mib"] for ranks in rounds for r in ranks),
        "state": [r["state"] for r in last],
        "state_mib": max(sum(r["state"].values()) for r in last) / MiB,
        "start_s": statistics.median(r["start_s"] for ranks in rounds for r in ranks),
        "phases_s": {  # rank 0's medians
            k: statistics.median(v for ranks in rounds for v in ranks[0]["phases"][k])
            for k in ranks0_phases(rounds)
        },
        "losses": losses,
        "threads": sorted({r["threads"] for ranks in rounds for r in ranks}),
    }


def ranks0_phases(rounds: list[list[dict[str, Any]]]) -> list[str]:
    return list(rounds[0][0]["phases"])


def table(mode: str, rows: list[dict[str, Any]], counts: dict[str, int]) -> str:
    base = next((r for r in rows if r["key"].startswith("sw3")), rows[0])
    lines = [
        f"{mode}: {counts[mode] / 1e6:.3f} M trainable of {counts['full'] / 1e6:.3f} M",
        "| system | median step s | vs " + SYSTEMS[base["key"].split("/")[0]] + " | CPU s/step "
        "| CPU vs | peak RSS MiB/rank | RSS vs | peak before step 1 | model state MiB/rank "
        "| data / fwd+bwd / opt s (rank 0) | start s | first loss | last loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rss = max(r["maxrss_mib"])
        lines.append(
            f"| {SYSTEMS[r['key'].split('/')[0]]} | {r['step_s']:.3f} | "
            f"{r['step_s'] / base['step_s']:.2f} | {r['cpu_s']:.3f} | "
            f"{r['cpu_s'] / base['cpu_s']:.2f} | "
            f"{' / '.join(f'{m:,.0f}' for m in r['maxrss_mib'])} | "
            f"{rss / max(base['maxrss_mib']):.2f} | {r['load_peak_mib']:,.0f} | "
            f"{r['state_mib']:.1f} | "
            f"{' / '.join(f'{v:.3f}' for v in r['phases_s'].values())} | {r['start_s']:.1f} | "
            f"{r['losses'][0]:.6f} | {r['losses'][-1]:.6f} |"
        )
    by = {r["key"].split("/")[0]: r for r in rows}
    for anchor, mine in PAIRS:
        if anchor in by and mine in by:
            a, m = by[anchor], by[mine]
            lines.append(
                f"{SYSTEMS[anchor]} / {SYSTEMS[mine]}: step {a['step_s'] / m['step_s']:.2f}x, "
                f"CPU {a['cpu_s'] / m['cpu_s']:.2f}x, peak RSS "
                f"{max(a['maxrss_mib']) / max(m['maxrss_mib']):.2f}x (above 1: shardwise ahead)"
            )
    first = [r["losses"][0] for r in rows]
    spread = (max(first) - min(first)) / abs(min(first))
    lines.append(f"first-step losses agree within {spread:.1e} relative")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", choices=sorted(SIZES), default="base")
    ap.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    ap.add_argument("--systems", default="sw3,sw0,ds3,ddp", help=f"from {','.join(SYSTEMS)}")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per system and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of every system")
    ap.add_argument("--micro", type=int, default=4, help="examples per rank and step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192, help="the model's vocabulary rows")
    ap.add_argument("--deepspeed-python", default="/work/dsvenv/bin/python")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per system run")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--profile",
        choices=("steps", "startup"),
        help="print rank 0's ops over the timed steps (torch.profiler) or its whole run under "
        "cProfile (times are then not comparable)",
    )
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in SYSTEMS] + [
        m for m in args.modes if m not in ("lora", "full")
    ]
    if bad or not args.systems or not args.modes:
        ap.error(f"unknown {bad}: systems from {', '.join(SYSTEMS)}, modes lora, full")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1 or args.micro < 1:
        ap.error("--steps, --warmup, --rounds and --micro must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    version = source_version()
    load = os.getloadavg()
    t0 = time.perf_counter()
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="ft_problem_") as tmp:
        model_dir, counts = write_model(Path(tmp), args.model_size, args.vocab)
        total = (args.warmup + args.steps + 1) * WORLD * args.micro
        data = write_data(Path(tmp) / "train.jsonl", total)
        turns = [(m, s) for m in args.modes for s in args.systems]
        for rnd in range(args.rounds):
            for mode, system in turns if rnd % 2 == 0 else turns[::-1]:
                spec = {
                    "system": system,
                    "mode": mode,
                    "model_dir": str(model_dir),
                    "data": str(data),
                    "seq_len": args.seq_len,
                    "micro": args.micro,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "lr": LR,
                    "lora": LORA if mode == "lora" else None,
                    "profile": args.profile,
                }
                py = args.deepspeed_python if system.startswith("ds") else sys.executable
                t = time.perf_counter()
                ranks = launch(py, spec, args.timeout)
                runs.setdefault(f"{system}/{mode}", []).append(ranks)
                step = statistics.median(max(s) for s in zip(*(r["times"] for r in ranks)))
                print(
                    f"round {rnd + 1} {system:>4} {mode:>4}: median step {step:.3f} s "
                    f"({time.perf_counter() - t:.0f} s with start-up)",
                    flush=True,
                )
    load_end = os.getloadavg()
    rows = {k: summarize(k, v) for k, v in runs.items()}
    print(
        f"\n# Llama {args.model_size} (vocab {args.vocab}), {WORLD} ranks x {args.micro} "
        f"examples (seq <= {args.seq_len}), fp32 AdamW; {args.rounds} interleaved rounds x "
        f"({args.warmup} warm-up + {args.steps} timed steps); code {version}; load average "
        f"{load[0]:.2f} before, {load_end[0]:.2f} after; {time.perf_counter() - t0:.0f} s in all\n"
    )
    for mode in args.modes:
        print(table(mode, [rows[f"{s}/{mode}"] for s in args.systems], counts) + "\n")
    print(
        "per-round medians (s): "
        + "; ".join(
            f"{k} {', '.join(f'{m:.3f}' for m in r['round_medians_s'])}" for k, r in rows.items()
        )
    )
    for key, ranks in runs.items():
        if "profile" in ranks[-1][0]:
            print(f"\n## {key}, rank 0, --profile {args.profile}\n{ranks[-1][0]['profile']}")
    print("threads per rank: " + ", ".join(f"{k} {r['threads']}" for k, r in rows.items()))
    if args.json:
        out = {"source": version, "args": {k: str(v) for k, v in vars(args).items()}}
        out |= {"load": [load[0], load_end[0]], "params": counts, "rows": list(rows.values())}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

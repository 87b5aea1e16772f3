"""Starting a Llama bigger than a rank should hold: each rank's resident memory during
initialize + load, shardwise's streaming load beside today's path (the whole model on every
rank) and beside DeepSpeed ``zero.Init`` + ``GatheredParameters``.

    python benchmarks/big_model_init.py [--size big|tiny] [--dir DIR]
        [--systems sw3,swtp,full,ds3,dshf] [--deepspeed-python /work/dsvenv/bin/python]
        [--rss-cap-gib 12] [--json out.json]

The model: a Llama of ``--size`` (``big``: hidden 1024, 28 layers, intermediate 2816, vocab
32000, 425 M parameters, 1.70 GB in fp32; ``tiny`` for a quick check) built once on the CPU in
a child process with seed 0 and written by ``save_pretrained(max_shard_size="500MB")`` into
``--dir`` (reused when it is there).

Systems, each 4 fresh rank processes (gloo, one thread each), one system after another:
``sw3`` shardwise ZeRO-3: the model built under ``shardwise.deferred_init()`` (meta), then
``shardwise.initialize(model, AdamW, Config(zero_stage=3), weights=dir)`` (streamed);
``swtp`` shardwise dp2 x tp2, ZeRO-1: the meta model through ``shardwise.parallelize`` with
the Llama tensor plan, then the same streamed ``initialize``; ``full`` today's path:
``LlamaForCausalLM.from_pretrained(dir)`` on every rank, then ``initialize`` at ZeRO-3;
``ds3`` DeepSpeed: ``LlamaForCausalLM(config)`` under ``deepspeed.zero.Init``, every parameter
loaded through ``GatheredParameters([p], modifier_rank=0)`` with rank 0 reading the
safetensors files one tensor at a time (DeepSpeed's documented recipe for pretrained weights
under ``zero.Init``), then ``deepspeed.initialize`` at ZeRO-3 (run by ``--deepspeed-python``);
``dshf`` the same through ``transformers``: ``from_pretrained`` while an ``HfDeepSpeedConfig``
at ZeRO-3 lives (the ``Trainer``'s path: ``zero.Init`` build, each module's weights gathered
with ``modifier_rank=0`` and loaded), then ``deepspeed.initialize``.

Per rank (see ``big_model_ranks.py``): the baseline resident set before the model is built
(after imports and the process group), the peak inside initialize + load (``VmHWM``, reset
when the window opens), the resident set after, ``ru_maxrss`` (lifetime), the window's wall
time, and the formula figure: the final model state per rank as the engine reports it
(shardwise ``engine.memory()``: params + grads + optimizer + buffers; DeepSpeed: its
partitions, flat fp32 buffers and optimizer state) plus the largest tensor one rank holds whole
while loading (shardwise: its largest local parameter; DeepSpeed: the largest full parameter,
which ``GatheredParameters`` gathers). The launcher also samples every rank's resident memory
each 50 ms (``VmRSS``, and ``RssAnon``: private memory, which the four ranks' sum of is the
machine's real cost) and stops a system whose ranks together hold more private memory than
``--rss-cap-gib`` or that leaves the machine under 3 GiB (the table says so). ``VmRSS`` and
``VmHWM`` count file pages a rank maps (safetensors reads) beside its private memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import source_version
from rank_launch import start_ranks

HERE = Path(__file__).resolve().parent
WORLD = 4
MiB = 1 << 20
GiB = 1 << 30
FLOOR = 3 * GiB
"""A system is stopped when the machine has less memory available than this."""
SYSTEMS = {
    "sw3": "shardwise ZeRO-3, streamed (meta + weights=dir)",
    "swtp": "shardwise dp2 x tp2 ZeRO-1, streamed",
    "full": "today: from_pretrained on every rank + ZeRO-3",
    "ds3": "DeepSpeed zero.Init + GatheredParameters, ZeRO-3",
    "dshf": "DeepSpeed via transformers from_pretrained (HfDeepSpeedConfig), ZeRO-3",
}
SIZES = {  # hidden, intermediate, layers, heads, vocab
    "tiny": (128, 344, 4, 4, 1024),
    "big": (1024, 2816, 28, 16, 32000),
}


def write_model(out: Path, size: str) -> None:
    """The Llama of ``size`` (seed 0) saved into ``out`` in 500 MB shards (run in a child
    process: the whole model is held once, then the process ends)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, vocab = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    shard = "500MB" if size == "big" else "200KB"  # several files either way
    model.save_pretrained(out, max_shard_size=shard, safe_serialization=True)
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    (out / "bench_model.json").write_text(
        json.dumps({"size": size, "params": numel, "bytes": 4 * numel, "largest": 4 * largest})
    )


def model_dir(root: Path, size: str) -> tuple[Path, dict[str, Any]]:
    """``root/size``, written by a child process unless it is already there; its figures."""
    out = root / size
    info = out / "bench_model.json"
    if not (info.is_file() and (out / "model.safetensors.index.json").is_file()):
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
        cmd = [sys.executable, __file__, "--write", str(out), "--size", size]
        subprocess.run(cmd, env=env, check=True)
    return out, json.loads(info.read_text())


def _rss(pid: int) -> tuple[int, int]:
    """``VmRSS`` and ``RssAnon`` (private memory: file pages several ranks map count once in
    the machine's memory but in each one's ``VmRSS``) of process ``pid``, bytes."""
    out = {"VmRSS": 0, "RssAnon": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out["VmRSS"], out["RssAnon"]


def _available() -> int:
    """The machine's ``MemAvailable``, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _start(python: str, spec_path: Path, tmp: Path) -> list[tuple[subprocess.Popen, Any]]:
    return start_ranks(python, HERE / "big_model_ranks.py", spec_path, tmp, WORLD)


def launch(python: str, spec: dict[str, Any], timeout_s: float, cap: int) -> dict[str, Any]:
    """The 4 ranks of one system as fresh processes, their ``VmRSS`` sampled every 50 ms; the
    ranks' results, or the error that stopped them."""
    with tempfile.TemporaryDirectory(prefix="big_init_") as tmp_s:
        tmp = Path(tmp_s)
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps({**spec, "out": tmp_s}))
        procs = _start(python, spec_path, tmp)
        sampled, together, stop = [0] * WORLD, 0, ""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p, _ in procs):
            now = [_rss(p.pid) if p.poll() is None else (0, 0) for p, _ in procs]
            sampled = [max(a, rss) for a, (rss, _) in zip(sampled, now)]
            private = sum(anon for _, anon in now)
            together = max(together, private)
            if private > cap or _available() < FLOOR:
                stop = (
                    f"stopped by the launcher: the ranks held {private / GiB:.1f} GiB private "
                    f"memory together, {_available() / GiB:.1f} GiB left on the machine"
                )
            elif time.monotonic() > deadline:
                stop = f"stopped: still running after {timeout_s:.0f} s"
            if stop:
                for p, _ in procs:
                    p.kill()
            time.sleep(0.05)
        for p, log in procs:
            p.wait()
            log.close()
        ranks = []
        for r in range(WORLD):
            out = tmp / f"rank{r}.json"
            if out.is_file():
                ranks.append(json.loads(out.read_text()))
            else:
                tail = (tmp / f"rank{r}.log").read_text()[-2000:]
                ranks.append({"error": stop or f"rank {r} wrote no result", "log": tail})
        codes = [p.returncode for p, _ in procs]
        return {"ranks": ranks, "sampled": sampled, "together": together, "codes": codes}


def _cell(ranks: list[dict[str, Any]], key: str, scale: float = MiB, fmt: str = ",.0f") -> str:
    vals = [r.get(key) for r in ranks]
    if any(v is None for v in vals):
        return "-"
    return f"{max(vals) / scale:{fmt}}"


def table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per system: per-rank maxima (MiB) and the ratio of the peak to shardwise
    ZeRO-3's."""
    base = rows.get("sw3")
    base_peak = max((r.get("peak", 0) for r in base["ranks"]), default=0) if base else 0
    lines = [
        "| system | baseline MiB | peak in init+load MiB | peak - baseline | x sw3 | after MiB "
        "| ru_maxrss MiB | sampled VmRSS MiB | private GiB, 4 ranks | formula: state + largest "
        "MiB | wall s | load correct |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        ranks = row["ranks"]
        errors = sorted({r["error"] for r in ranks if "error" in r})
        if errors:
            lines.append(
                f"| {SYSTEMS[key]} | FAILED: {'; '.join(e[:300] for e in errors)} (sampled "
                f"VmRSS reached {max(row['sampled']) / MiB:,.0f} MiB on a rank, "
                f"{row['together'] / GiB:.2f} GiB private memory together) |"
            )
            continue
        peak = max(r["peak"] for r in ranks)
        share = max(r["peak"] - r["baseline"] for r in ranks)
        formula = max(r["state"] + r["largest"] for r in ranks)
        ratio = f"{peak / base_peak:.2f}" if base_peak else "-"
        checks = {r.get("check") for r in ranks}
        lines.append(
            f"| {SYSTEMS[key]} | {_cell(ranks, 'baseline')} | {peak / MiB:,.0f} | "
            f"{share / MiB:,.0f} | {ratio} | {_cell(ranks, 'after')} | "
            f"{_cell(ranks, 'maxrss')} | {max(row['sampled']) / MiB:,.0f} | "
            f"{row['together'] / GiB:.2f} | {formula / MiB:,.0f} | "
            f"{_cell(ranks, 'wall_s', 1, '.1f')} | "
            f"{'/'.join(str(c) for c in sorted(checks, key=str))} |"
        )
    return "\n".join([*lines, "", *ratios(rows)])


def ratios(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each system's peak and its peak above the baseline (the model's share) against
    shardwise ZeRO-3's, the largest rank of each."""
    ok = {k: r["ranks"] for k, r in rows.items() if not any("error" in x for x in r["ranks"])}
    if "sw3" not in ok:
        return []
    peak = {k: max(x["peak"] for x in v) for k, v in ok.items()}
    share = {k: max(x["peak"] - x["baseline"] for x in v) for k, v in ok.items()}
    return [
        f"{SYSTEMS[k]} / shardwise ZeRO-3: peak {peak[k] / peak['sw3']:.2f}x, above the "
        f"baseline {share[k] / share['sw3']:.2f}x"
        for k in ok
        if k != "sw3"
    ]


def per_rank(rows: dict[str, dict[str, Any]]) -> str:
    """Every rank's baseline / peak / formula, MiB."""
    out = []
    for key, row in rows.items():
        cells = [
            f"{r['baseline'] / MiB:,.0f}/{r['peak'] / MiB:,.0f}/"
            f"{(r['state'] + r['largest']) / MiB:,.0f}"
            for r in row["ranks"]
            if "error" not in r
        ]
        extra = ""
        if "init_peak" in row["ranks"][0]:
            extra = f"; engine init_peak {_cell(row['ranks'], 'init_peak')} MiB"
        out.append(f"{key}: {' | '.join(cells) or 'failed'}{extra}")
    return "\n".join(out)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="big")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "big_model_init")
    ap.add_argument("--systems", default="sw3,swtp,full,ds3,dshf", help=f"from {','.join(SYSTEMS)}")
    ap.add_argument("--deepspeed-python", default="/work/dsvenv/bin/python")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per system")
    ap.add_argument("--rss-cap-gib", type=float, default=12.0, help="private memory, all ranks")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # the child that writes
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        ap.error(f"unknown systems {bad}: choose from {', '.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.write is not None:
        write_model(args.write, args.size)
        return 0
    version, load = source_version(), os.getloadavg()
    t0 = time.perf_counter()
    path, info = model_dir(args.dir, args.size)
    print(
        f"model: Llama {args.size} {SIZES[args.size]} (hidden, intermediate, layers, heads, "
        f"vocab): {info['params']:,} parameters, {info['bytes']:,} bytes fp32 "
        f"({info['bytes'] / GiB:.2f} GiB), largest tensor {info['largest'] / MiB:.1f} MiB; "
        f"{len(list(path.glob('*.safetensors')))} safetensors files in {path}",
        flush=True,
    )
    rows: dict[str, dict[str, Any]] = {}
    for system in args.systems:
        py = args.deepspeed_python if system.startswith("ds") else sys.executable
        spec = {"system": system, "model_dir": str(path)}
        t = time.perf_counter()
        rows[system] = launch(py, spec, args.timeout, int(args.rss_cap_gib * GiB))
        print(f"{system}: {time.perf_counter() - t:.0f} s with start-up", flush=True)
        print(table({system: rows[system]}).splitlines()[2], flush=True)
    load_end = os.getloadavg()
    print(
        f"\n# initialize + load at {WORLD} ranks (gloo, one thread each), fp32, AdamW; code "
        f"{version}; load average {load[0]:.2f} before, {load_end[0]:.2f} after; "
        f"{time.perf_counter() - t0:.0f} s in all; MiB are per-rank maxima\n"
    )
    print(table(rows))
    print("\nper rank, baseline/peak/formula MiB:\n" + per_rank(rows))
    for key, row in rows.items():
        for r, rank in enumerate(row["ranks"]):
            if "error" in rank and r == 0:
                print(f"\n{key} rank 0: {rank.get('trace') or rank.get('log', '')}")
    if args.json:
        out = {"source": version, "args": {k: str(v) for k, v in vars(args).items()}}
        out |= {"load": [load[0], load_end[0]], "model": info, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

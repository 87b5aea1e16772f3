"""``shardwise report``: plots of a run and one HTML page that shows them with its figures.

Reads ``config.json``, ``metrics.jsonl`` and (once the run ended) ``summary.json`` of a run
directory; writes ``loss.png``, ``throughput.png``, ``memory.png``, ``comm.png`` and
``report.html`` into ``<run>/report/`` (or another directory); for an ``--auto`` run also
``prediction.png``, the cost model's step against the measured one. Works on a run still in
progress.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from shardwise.bytesize import format_bytes
from shardwise.train import plots
from shardwise.train.metrics import read_metrics
from shardwise.train.options import RunConfig
from shardwise.train.plan_check import PlanCheck
from shardwise.train.progress import format_duration, format_rate
from shardwise.train.rundir import RunDir
from shardwise.train.summary import build_summary, read_summary

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
td, th { padding: 3px 12px; border-bottom: 1px solid #ddd; text-align: left; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.headline { display: flex; gap: 1em; flex-wrap: wrap; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 1em; min-width: 10em; }
.card .v { font-size: 1.5em; font-weight: 600; } .card .k { color: #666; font-size: 0.85em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.4em 0; }
.cols { display: flex; gap: 2em; flex-wrap: wrap; align-items: flex-start; }
"""


def _cards(summary: dict[str, Any]) -> str:
    val, base = summary.get("final_val_loss"), summary.get("unigram_baseline")
    rate = summary.get("tokens_per_s")
    cards = [
        ("final validation loss", "n/a" if val is None else f"{val:.3f} nats"),
        ("unigram baseline", "n/a" if base is None else f"{base:.3f} nats"),
    ]
    if val is not None and base:
        cards.append(("below the baseline", f"{100 * (1 - val / base):.0f}%"))
    cards += [
        ("throughput", format_rate(rate) if rate else "n/a"),
        ("wall time", format_duration(summary.get("wall_time_s") or 0)),
        ("steps", f"{summary.get('steps', 0)} ({summary.get('status', '?')})"),
    ]
    return (
        '<div class="headline">'
        + "".join(
            f'<div class="card"><div class="v">{html.escape(v)}</div>'
            f'<div class="k">{html.escape(k)}</div></div>'
            for k, v in cards
        )
        + "</div>"
    )


def _table(rows: list[list[str]], header: list[str], numeric: bool = True) -> str:
    """An HTML table; with ``numeric`` every column but the first is right-aligned."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"num" if i and numeric else ""}">{html.escape(c)}</td>'
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _memory_table(summary: dict[str, Any]) -> str:
    est = summary["memory"]["estimated_per_rank"]
    measured = summary["memory"]["measured_peak_per_rank"]
    header = ["bytes per rank", "estimated"] + [f"rank {r} (peak)" for r in range(len(measured))]
    rows = []
    for key in ("params", "grads", "optimizer", "model_states"):
        rows.append(
            [key.replace("_", " "), format_bytes(est[key])]
            + [format_bytes(m.get(key, 0)) for m in measured]
        )
    rows.append(
        ["activations", format_bytes(est["activations"])] + ["not measured"] * len(measured)
    )
    return _table(rows, header)


def _config_tables(config: dict[str, Any]) -> str:
    parts = []
    for title, key in (
        ("training", "train"),
        ("engine (shardwise.Config)", "shardwise"),
        ("model", "model"),
        ("derived", "derived"),
    ):
        values = config.get(key, {})
        rows = [[k, json.dumps(v)] for k, v in values.items() if k != "extra"]
        table = _table(rows, ["key", "value"], numeric=False)
        parts.append(f"<div><h3>{html.escape(title)}</h3>{table}</div>")
    return '<div class="cols">' + "".join(parts) + "</div>"


def _page(
    run_dir: RunDir, config: dict[str, Any], summary: dict[str, Any], images: dict[str, str]
) -> str:
    title = f"shardwise run {run_dir.root.name}"
    figs = "".join(
        f'<h2>{html.escape(caption)}</h2><img src="{name}" alt="{caption}">'
        for caption, name in images.items()
    )
    world = config.get("world_size", "?")
    train = config.get("train", {})
    eng = config.get("shardwise", {})
    line = (
        f"{train.get('model')} model, {world} ranks, ZeRO-{eng.get('zero_stage')}, "
        f"{eng.get('precision')}, {config.get('derived', {}).get('tokens_per_step')} "
        f"tokens per step"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>{html.escape(line)}</p>{_cards(summary)}"
        f"<h2>Memory: estimated vs measured</h2>{_memory_table(summary)}"
        f"{figs}<h2>Configuration</h2>{_config_tables(config)}</body></html>\n"
    )


def write_report(run_root: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the plots and ``report.html`` for the run in ``run_root``; returns the paths."""
    run_dir = RunDir(run_root).require()
    records = read_metrics(run_dir.metrics)
    if not records:
        raise ValueError(f"{run_dir.metrics} holds no step yet: wait for the first steps")
    config = json.loads(run_dir.config.read_text())
    run = RunConfig.from_dict(config)
    summary = read_summary(run_dir.summary)
    if summary is None:  # still running: figures so far, no baseline yet
        vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
        summary = build_summary(
            run,
            records,
            status="running",
            unigram_baseline=None,
            final_val_loss=vals[-1] if vals else None,
            wall_time_s=records[-1].get("wall_s", records[-1].get("elapsed_s", 0.0)),
        )
    out = out_dir or run_dir.report
    out.mkdir(parents=True, exist_ok=True)
    estimate = summary["memory"]["estimated_per_rank"]
    images = {
        "Training and validation loss": plots.plot_loss(
            records, summary.get("unigram_baseline"), out / "loss.png"
        ).name,
        "Throughput": plots.plot_throughput(records, out / "throughput.png").name,
        "Memory per rank by category": plots.plot_memory(
            records, estimate, out / "memory.png"
        ).name,
        "Communication vs computation": plots.plot_comm(records, out / "comm.png").name,
    }
    check = PlanCheck.load(run_dir.root)  # an --auto run: its prediction against its steps
    if check is not None:
        from shardwise.train.plan_plots import plot_prediction

        plan = summary.get("plan") or check.summary(records, [])
        images["Predicted against measured step time"] = plot_prediction(
            records, plan, out / "prediction.png"
        ).name
    page = out / "report.html"
    page.write_text(_page(run_dir, config, summary, images), encoding="utf-8")
    return [out / name for name in images.values()] + [page]

"""``summary.json``: the headline figures of a run, written by rank 0 when it ends.

Keys: ``status`` ("finished" or "stopped by SIGINT"...), ``steps``, ``final_val_loss``,
``unigram_baseline`` (nats/token of byte frequencies alone), ``tokens_trained``,
``tokens_per_s`` (training tokens over the summed step times), ``wall_time_s`` (the whole run:
every launch of a resumed run, each from the start of its ranks to its end or last record),
``memory`` (per rank: measured peak bytes by category next to ``shardwise.estimate``'s
model-state estimate for the run's stage, precision and world size, plus the estimated
activation bytes); in an ``--auto`` run, ``plan``: the chosen layout with its predicted and
measured step, terms, memory and communication (``shardwise.train.plan_check``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.costmodel.memory import zero_shard_size
from shardwise.estimate import estimate_activations, estimate_model_states
from shardwise.train.options import RunConfig

CATEGORIES = ("params", "grads", "optimizer", "buffers", "comm")
"""Memory categories of ``Engine.memory()`` that add up to what a rank holds."""


def peak_memory(records: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Per rank, the largest bytes seen in each category over the step records."""
    peaks: list[dict[str, int]] = []
    for record in records:
        for rank, mem in enumerate(record.get("memory") or []):
            if rank == len(peaks):
                peaks.append({})
            for key, value in mem.items():
                peaks[rank][key] = max(peaks[rank].get(key, 0), int(value))
    return peaks


def memory_estimate(run: RunConfig) -> dict[str, int]:
    """Estimated bytes per rank: model states for the run's ZeRO stage, and activations."""
    cfg = run.model
    est = estimate_model_states(
        run.params_per_rank(),
        zero_shard_size(run.dp_size * run.train.cp, run.train.dp_replicate),  # dp x cp
        run.engine.precision,
        offload=run.engine.offload_optimizer,
        reduce_dtype=run.engine.reduce_dtype,
    )[run.engine.zero_stage]
    act = estimate_activations(
        cfg,
        run.micro_batch,
        cfg.seq_len // run.train.cp,  # a cp rank's tokens of each sequence
        run.engine.precision,
        checkpointing=bool(run.engine.activation_checkpointing),
    )
    return {
        "params": est.params_bytes,
        "grads": est.grads_bytes,
        "optimizer": est.optimizer_bytes,
        "model_states": est.total_bytes,
        "activations": act,
    }


def build_summary(
    run: RunConfig,
    records: list[dict[str, Any]],
    *,
    status: str,
    unigram_baseline: float | None,
    final_val_loss: float | None,
    wall_time_s: float,
) -> dict[str, Any]:
    """The summary of a run from its step records (of every launch, for a resumed run)."""
    step_time = sum(r.get("step_time_s", 0.0) for r in records)
    tokens = sum(r.get("tokens", 0) for r in records)
    peaks = peak_memory(records)
    measured = [
        {**p, "model_states": sum(p.get(k, 0) for k in ("params", "grads", "optimizer"))}
        for p in peaks
    ]
    return {
        "status": status,
        "steps": records[-1]["step"] if records else 0,
        "final_val_loss": final_val_loss,
        "unigram_baseline": unigram_baseline,
        "final_train_loss": records[-1]["loss"] if records else None,
        "tokens_trained": tokens,
        "tokens_per_s": tokens / step_time if step_time > 0 else None,
        "wall_time_s": wall_time_s,
        "world_size": run.world_size,
        "memory": {
            # the estimate is the built-in GPT's; a fine-tuning run has none
            "estimated_per_rank": memory_estimate(run) if run.finetune is None else None,
            "measured_peak_per_rank": measured,
        },
    }


def discard_summary(path: Path) -> None:
    """Remove the summary of an earlier launch when a resumed run starts: if this launch
    crashes, no summary claims the run ended (a summary is only the run that actually ended)."""
    path.unlink(missing_ok=True)


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)


def read_summary(path: Path) -> dict[str, Any] | None:
    """The summary, or None if the run has not ended (or never wrote one)."""
    return json.loads(path.read_text()) if path.is_file() else None

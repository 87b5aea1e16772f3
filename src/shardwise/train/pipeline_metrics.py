"""What a pipeline-parallel run records per step in ``metrics.jsonl``: forward and backward
seconds of every stage, as the executor timed its compute actions, and the measured bubble.

Each rank reports its own stages (``local_times``); rank 0 joins those of one pipeline, the pp
ranks at dp 0 and tp 0 (``pipeline_record``)."""

from __future__ import annotations

from typing import Any

from shardwise.mesh import Mesh
from shardwise.parallel.pipeline.executor import PipelineExecutor


def local_times(executor: PipelineExecutor) -> dict[str, Any]:
    """This rank's stage seconds, compute seconds and wall seconds over the steps the executor
    ran since the last call (one per accumulation step of an optimizer step)."""
    stages: dict[int, dict[str, float]] = {}
    busy_s = wall_s = 0.0
    for times in executor.take_step_times():
        busy_s += times.busy_s
        wall_s += times.wall_s
        for stage, seconds in times.stage_seconds().items():
            entry = stages.setdefault(stage, {"forward_s": 0.0, "backward_s": 0.0})
            for key, value in seconds.items():
                entry[key] += value
    return {
        "stages": [{"stage": s, **stages[s]} for s in sorted(stages)],
        "busy_s": busy_s,
        "wall_s": wall_s,
    }


def pipeline_record(parts: list[dict[str, Any]], mesh: Mesh) -> dict[str, Any]:
    """The step's ``pipeline`` entry from every rank's step part (in world-rank order):
    ``stages`` (stage, its pp rank, forward_s, backward_s) and ``bubble_fraction``, the share
    of the pp ranks' summed wall time in which they computed nothing (waiting on a
    neighbour or a send), measured, not simulated."""
    stages: list[dict[str, Any]] = []
    busy_s = wall_s = 0.0
    for pp_rank in range(mesh.pp_size):
        own = parts[mesh.rank_of(pp=pp_rank, dp=0, cp=0, tp=0)]["pipeline"]
        stages += [{**s, "pp_rank": pp_rank} for s in own["stages"]]
        busy_s += own["busy_s"]
        wall_s += own["wall_s"]
    return {
        "stages": sorted(stages, key=lambda s: s["stage"]),
        "bubble_fraction": 1.0 - busy_s / wall_s if wall_s > 0 else 0.0,
    }

"""``metrics.jsonl``: one JSON object per optimizer step, written by rank 0.

Keys of a step record (units in the names where they have one):

- ``step``: optimizer steps done, counting this one (1-based).
- ``loss``: training loss of the step, averaged over ranks and micro-batches (nats/token).
- ``lr``: learning rate the step used. ``grad_norm``: global gradient L2 norm before clipping.
- ``tokens``: training tokens of the step over all ranks; ``tokens_per_s``: ``tokens`` over
  ``step_time_s``, the slowest rank's wall time of forward, backward and optimizer step.
- ``comm``: rank 0's collectives of the step, ``{op: {"calls", "bytes", "seconds",
  "inter_node_bytes"}}``;
  ``exposed_comm_s``: per rank, seconds blocked on communication (not overlapped with compute).
- ``memory``: per rank, ``Engine.memory()`` bytes by category, taken after the last backward of
  the step, when gradients are held (under ``--pp``: after the step).
- ``pipeline``: only under ``--pp``, ``{"stages": [{"stage", "pp_rank", "forward_s",
  "backward_s"}], "bubble_fraction"}`` (see ``shardwise.train.pipeline_metrics``).
- ``optimizer_s``: without ``--pp``, the slowest rank's seconds in the optimizer step.
- ``predicted_step_time_s``: only in an ``--auto`` run, the cost model's step time of the chosen
  layout (see ``shardwise.train.plan_check``).
- ``val_loss``: only on evaluation steps, the validation loss averaged over ranks.
- ``elapsed_s``: seconds since the ranks started (this launch); ``wall_s``: seconds of the whole
  run so far, over every launch of a resumed run (earlier launches up to their last record).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("shardwise.train")


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: store those as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class MetricsWriter:
    """Appends step records to ``metrics.jsonl``, one flushed line each.

    Args:
        path: the file; created if missing.
        resume_step: on a resumed run, the step the run restarts from (0 when it starts over):
            records after it (steps trained but not checkpointed, which are trained again) are
            dropped first, so every step appears once. Nothing else is ever cut.

    ``prior_wall_s`` is the wall time of the earlier launches of the run: the ``wall_s`` (or,
    in files written before it existed, ``elapsed_s``) of the file's last record before the cut.
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self.prior_wall_s = 0.0
        if resume_step is not None and path.exists():
            records = read_metrics(path)
            if records:
                last = records[-1]
                self.prior_wall_s = float(last.get("wall_s", last.get("elapsed_s")) or 0.0)
            kept = [r for r in records if r.get("step", 0) <= resume_step]
            if (kept[-1].get("step", 0) if kept else 0) < resume_step:
                log.warning(
                    "%s ends before step %d, where the run resumes: the steps in between "
                    "have no record",
                    path,
                    resume_step,
                )
            if len(kept) < len(records):
                log.warning(
                    "%s: dropping %d records after step %d (trained again from that step)",
                    path,
                    len(records) - len(kept),
                    resume_step,
                )
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(path)
        elif resume_step is None and path.exists():
            path.unlink()
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (non-finite floats become null)."""
        if self._file is None:
            raise ValueError(f"metrics file {self.path} is closed")
        self._file.write(json.dumps(_finite(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics file, in order (a torn last line is skipped)."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist: the run has not logged any step yet")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return records

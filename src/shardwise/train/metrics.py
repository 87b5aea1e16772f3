"""``metrics.jsonl``: one JSON object per optimizer step, written by rank 0.

Keys of a step record (units in the names where they have one):

- ``step``: optimizer steps done, counting this one (1-based).
- ``loss``: training loss of the step, averaged over ranks and micro-batches (nats/token).
- ``lr``: learning rate the step used. ``grad_norm``: global gradient L2 norm before clipping.
- ``tokens``: training tokens of the step over all ranks; ``tokens_per_s``: ``tokens`` over
  ``step_time_s``, the slowest rank's wall time of forward, backward and optimizer step.
- ``comm``: rank 0's collectives of the step, ``{op: {"calls", "bytes", "seconds"}}``;
  ``exposed_comm_s``: per rank, seconds blocked on communication (not overlapped with compute).
- ``memory``: per rank, ``Engine.memory()`` bytes by category, taken after the last backward of
  the step, when gradients are held.
- ``val_loss``: only on evaluation steps, the validation loss averaged over ranks.
- ``elapsed_s``: seconds since the ranks started (this launch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any


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
        resume_step: on a resumed run, the step the run restarts from: records after it (steps
            that were trained but not checkpointed) are dropped first, so every step appears
            once.
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
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

"""Names of everything a ``shardwise train`` run puts on disk.

A run directory holds::

    runs/20250101-120000/
      config.json              resolved run config: engine Config, train options, derived values
      metrics.jsonl            one JSON object per optimizer step (see metrics.py)
      summary.json             headline figures, written when the run ends (see summary.py)
      final_model.safetensors  full model weights at the last step, written by rank 0
      checkpoints/             sharded checkpoints (see shardwise.checkpoint.layout)
      report/                  plots and report.html from ``shardwise report``

Every path inside a run directory is relative to it: ``config.json`` stores ``checkpoint_dir``
as ``"checkpoints"``, and a run always saves into and resumes from the ``checkpoints/`` of the
directory it was started in (:meth:`RunDir.engine_config`). A moved or copied run directory
therefore uses its own checkpoints and never writes outside itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.config import Config

log = logging.getLogger("shardwise.train")

CHECKPOINTS_NAME = "checkpoints"
"""``config.json``'s ``checkpoint_dir``: relative to the run directory."""

RUNS_ROOT = Path("runs")
"""Where run directories go when ``--run-dir`` is not given (relative to the working dir)."""


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def final_model(self) -> Path:
        return self.root / "final_model.safetensors"

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_NAME

    @property
    def report(self) -> Path:
        return self.root / "report"

    def engine_config(self, config: Config) -> Config:
        """``config`` with ``checkpoint_dir`` set to this directory's ``checkpoints/``.

        A stored relative ``checkpoint_dir`` is taken relative to this directory; one that
        points anywhere else (an absolute path written before paths were relative, or the
        original's path in a moved or copied run directory) is replaced, with a warning: a
        run never reads or writes another directory's checkpoints.
        """
        own = self.checkpoints
        stored = config.checkpoint_dir
        if stored is not None:
            where = self.root / stored if not Path(stored).is_absolute() else Path(stored)
            if where.resolve() != own.resolve():
                log.warning(
                    "config.json names checkpoint_dir %s, which is not this run directory's "
                    "(it was moved or copied): using %s",
                    stored,
                    own,
                )
        return config.replace(checkpoint_dir=str(own))

    def exists(self) -> bool:
        """Whether a run was started here (its config is written)."""
        return self.config.is_file()

    def require(self) -> RunDir:
        """Return self, or raise ``ValueError`` if no run was started here."""
        if not self.root.is_dir():
            raise ValueError(f"run directory {self.root} does not exist")
        if not self.exists():
            raise ValueError(
                f"{self.root} holds no config.json: pass the directory of a shardwise train run"
            )
        return self


def new_run_dir(root: Path = RUNS_ROOT) -> RunDir:
    """A fresh ``runs/<YYYYmmdd-HHMMSS>`` path (suffixed ``-1``, ``-2``... if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 0
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return RunDir(path)


def latest_run_dir(root: Path = RUNS_ROOT) -> RunDir:
    """The most recently started run under ``root``; ``ValueError`` when there is none."""
    runs = [RunDir(p) for p in root.iterdir() if RunDir(p).exists()] if root.is_dir() else []
    if not runs:
        raise ValueError(f"no run directory under {root}/ to resume: pass --run-dir")
    return max(runs, key=lambda r: r.config.stat().st_mtime)

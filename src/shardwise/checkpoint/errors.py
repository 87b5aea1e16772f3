"""The one exception type the checkpoint layer raises for damaged or missing saved state."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, uncommitted or of an unknown format.

    ``path`` is the exact file (or directory) at fault and ``problem`` says what is wrong with it,
    so a message reads ``<path>: <problem>``.
    """

    def __init__(self, problem: str, path: Path | str | None = None) -> None:
        self.problem = problem
        self.path = Path(path) if path is not None else None
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)

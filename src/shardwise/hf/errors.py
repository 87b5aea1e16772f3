"""The one error type for Hugging Face weights on disk: it names the file and the tensor."""

from __future__ import annotations

from pathlib import Path


class WeightsError(ValueError):
    """A weights file or directory that cannot be read or written as asked.

    ``path`` is the file at fault (or the directory), ``tensor`` the tensor name when one is
    involved, ``problem`` what is wrong; the message reads ``<path>: tensor '<name>': <problem>``
    on one line, so every rank raising it reports the same thing.
    """

    def __init__(self, problem: str, path: Path | str | None = None, tensor: str | None = None):
        self.problem = problem
        self.path = Path(path) if path is not None else None
        self.tensor = tensor
        where = [] if self.path is None else [str(self.path)]
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(": ".join([*where, problem]))

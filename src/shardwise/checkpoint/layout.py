"""Names of everything a checkpoint puts on disk, and the one error type for saved state.

A checkpoint root holds::

    root/
      journal.log                         append-only write-ahead journal (see journal.py)
      step-00000100/                      one committed checkpoint
        manifest.json                     what is where, with checksums (see manifest.py)
        shard-00000-of-00002.safetensors  rank 0's boxes, key "<name>@<offset>,<offset>..."
        shard-00001-of-00002.safetensors
        rank-00000.safetensors            rank 0's own state (RNG states...): tensors + JSON
        rank-00001.safetensors
      .tmp-step-00000200/                 a save in progress (or an interrupted one)
      damaged-step-00000300/              a step set aside as damaged, kept for inspection

A directory only counts as a checkpoint when the journal holds its commit record. Every file a
manifest names is a plain name inside its step directory: :func:`member` refuses anything else.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_VERSION = 2
"""Written by this version. 2: boxes with n-d offsets, rank states as safetensors + JSON."""
READABLE_FORMAT_VERSIONS = (1, 2)
"""1: flat ranges of row-major tensors, pickled rank states (read without unpickling)."""

JOURNAL_NAME = "journal.log"
MANIFEST_NAME = "manifest.json"
MANIFEST_TMP_NAME = "manifest.json.tmp"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
SET_ASIDE_PREFIX = "damaged-step-"

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_TMP_RE = re.compile(r"^\.tmp-step-(\d{8,})$")
_PLAIN_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, uncommitted or of an unknown format.

    ``path`` is the exact file (or directory) at fault and ``problem`` says what is wrong with it,
    so a message reads ``<path>: <problem>``.
    """

    def __init__(self, problem: str, path: Path | str | None = None) -> None:
        self.problem = problem
        self.path = Path(path) if path is not None else None
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)


def step_dir_name(step: int) -> str:
    """``step-00000100`` for step 100."""
    return f"{STEP_PREFIX}{step:08d}"


def tmp_dir_name(step: int) -> str:
    """``.tmp-step-00000100``: where step 100 is written before its atomic rename."""
    return f"{TMP_PREFIX}{step:08d}"


def set_aside_name(step: int, attempt: int = 0) -> str:
    """``damaged-step-00000100`` (``-1``, ``-2``... when taken): a damaged step kept aside."""
    base = f"{SET_ASIDE_PREFIX}{step:08d}"
    return base if attempt == 0 else f"{base}-{attempt}"


def shard_file_name(rank: int, world_size: int) -> str:
    """``shard-00001-of-00004.safetensors``: the boxes written by ``rank``."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def rank_state_file_name(rank: int) -> str:
    """``rank-00001.safetensors``: the per-rank state of ``rank`` (tensors and JSON)."""
    return f"rank-{rank:05d}.safetensors"


def tensor_key(name: str, offsets: tuple[int, ...]) -> str:
    """Key of one box inside a shard file: the logical name and the box's offsets."""
    return f"{name}@{','.join(str(o) for o in offsets)}"


def parse_step_dir(path: Path | str) -> int | None:
    """The step of a ``step-NNNNNNNN`` directory name, or None for any other name."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def parse_tmp_dir(path: Path | str) -> int | None:
    """The step of a ``.tmp-step-NNNNNNNN`` directory name, or None for any other name."""
    m = _TMP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def split_step_path(path: Path | str) -> tuple[Path, int]:
    """``root/step-00000100`` -> ``(root, 100)``; CheckpointError for any other name."""
    p = Path(path)
    step = parse_step_dir(p)
    if step is None:
        raise CheckpointError(
            "not a checkpoint directory (expected a name like step-00000100, or pass the "
            "checkpoint root to find its latest step)",
            p,
        )
    return p.parent, step


def check_plain_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name (letters, digits, ``_.-``; no separator, not
    ``.``/``..``, not hidden); ValueError naming ``where`` otherwise."""
    if not isinstance(name, str) or not _PLAIN_RE.match(name) or name in (".", ".."):
        raise ValueError(
            f"{where}: file name {name!r} is not a plain file name inside the checkpoint "
            f"directory (letters, digits, '_', '.', '-'; no path separators or '..')"
        )
    return name


def member(step_dir: Path, name: str) -> Path:
    """The path of file ``name`` of a checkpoint, refused (CheckpointError) unless it is a plain
    name whose path stays inside ``step_dir`` (no symbolic link out of it)."""
    try:
        check_plain_name(name, "manifest")
    except ValueError as exc:
        raise CheckpointError(str(exc), step_dir / MANIFEST_NAME) from exc
    path = step_dir / name
    if path.is_symlink() or (path.exists() and path.resolve().parent != step_dir.resolve()):
        raise CheckpointError("is a link to a file outside the checkpoint directory; refused", path)
    return path

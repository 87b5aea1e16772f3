"""Names of everything a checkpoint puts on disk.

A checkpoint root holds::

    root/
      journal.log                         append-only write-ahead journal (see journal.py)
      step-00000100/                      one committed checkpoint
        manifest.json                     what is where, with checksums (see manifest.py)
        shard-00000-of-00002.safetensors  rank 0's pieces, key "<name>@<start>"
        shard-00001-of-00002.safetensors
        rank-00000.pkl                    rank 0's opaque state (RNG states...), pickled
        rank-00001.pkl
      .tmp-step-00000200/                 a save in progress (or an interrupted one)

A directory only counts as a checkpoint when the journal holds its commit record.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_VERSION = 1
JOURNAL_NAME = "journal.log"
MANIFEST_NAME = "manifest.json"
MANIFEST_TMP_NAME = "manifest.json.tmp"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_TMP_RE = re.compile(r"^\.tmp-step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    """``step-00000100`` for step 100."""
    return f"{STEP_PREFIX}{step:08d}"


def tmp_dir_name(step: int) -> str:
    """``.tmp-step-00000100``: where step 100 is written before its atomic rename."""
    return f"{TMP_PREFIX}{step:08d}"


def shard_file_name(rank: int, world_size: int) -> str:
    """``shard-00001-of-00004.safetensors``: the pieces written by ``rank``."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def rank_state_file_name(rank: int) -> str:
    """``rank-00001.pkl``: the pickled per-rank state of ``rank``."""
    return f"rank-{rank:05d}.pkl"


def tensor_key(name: str, start: int) -> str:
    """Key of one piece inside a shard file: the logical name and its flat start offset."""
    return f"{name}@{start}"


def parse_step_dir(path: Path | str) -> int | None:
    """The step of a ``step-NNNNNNNN`` directory name, or None for any other name."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def parse_tmp_dir(path: Path | str) -> int | None:
    """The step of a ``.tmp-step-NNNNNNNN`` directory name, or None for any other name."""
    m = _TMP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None

"""Fault-tolerant sharded checkpoints: each rank writes its boxes, rank 0 commits atomically.

Writing: :func:`save_checkpoint` (blocking) or :class:`AsyncCheckpointWriter` (background).
Reading: :func:`resolve`, :func:`verify`, :class:`CheckpointReader`, :func:`find_latest_valid`.
Retiring: :func:`delete_checkpoint`, :func:`set_aside`; a lost journal: :func:`rebuild_journal`;
before resuming: :func:`prepare_resume`.
Offline: :func:`inspect`, :func:`verify_cli`, :func:`read_consolidated`,
:func:`export_consolidated`.

Modules: ``layout`` (names on disk), ``entries`` (boxes and their geometry), ``files`` (durable
bytes, safetensors), ``manifest``, ``journal``, ``retention``, ``integrity``, ``rank_state``,
``writer``, ``async_writer``, ``reader``, ``tools``; crash test hook: ``faults``. Nothing here
knows the training engine: it saves and reads named boxes of tensors.
"""

from shardwise.checkpoint.async_writer import AsyncCheckpointWriter
from shardwise.checkpoint.entries import ShardEntry, entries_of_flat_range, flat_range_boxes
from shardwise.checkpoint.files import save_safetensors
from shardwise.checkpoint.integrity import (
    VerifyReport,
    find_latest_valid,
    rebuild_journal,
    verify,
)
from shardwise.checkpoint.journal import resolve
from shardwise.checkpoint.layout import FORMAT_VERSION, CheckpointError
from shardwise.checkpoint.manifest import Manifest, Piece, TensorRecord
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.retention import delete_checkpoint, prepare_resume, set_aside
from shardwise.checkpoint.tools import (
    export_consolidated,
    inspect,
    read_consolidated,
    verify_cli,
)
from shardwise.checkpoint.writer import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "AsyncCheckpointWriter",
    "CheckpointError",
    "CheckpointReader",
    "Manifest",
    "Piece",
    "ShardEntry",
    "TensorRecord",
    "VerifyReport",
    "delete_checkpoint",
    "entries_of_flat_range",
    "export_consolidated",
    "find_latest_valid",
    "flat_range_boxes",
    "inspect",
    "prepare_resume",
    "read_consolidated",
    "rebuild_journal",
    "resolve",
    "save_checkpoint",
    "save_safetensors",
    "set_aside",
    "verify",
    "verify_cli",
]

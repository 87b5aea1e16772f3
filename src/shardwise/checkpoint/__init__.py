"""Fault-tolerant sharded checkpoints: each rank writes its pieces, rank 0 commits atomically.

Writing: :func:`save_checkpoint` (blocking) or :class:`AsyncCheckpointWriter` (background).
Reading: :func:`resolve`, :func:`verify`, :class:`CheckpointReader`, :func:`find_latest_valid`.
Offline: :func:`inspect`, :func:`verify_cli`, :func:`export_consolidated`,
:func:`delete_checkpoint`. On-disk layout: see ``layout.py``; journal: ``journal.py``;
manifest: ``manifest.py``; crash test hook: ``faults.py``.
"""

from shardwise.checkpoint.async_writer import AsyncCheckpointWriter
from shardwise.checkpoint.cleanup import delete_checkpoint
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.integrity import VerifyReport, verify
from shardwise.checkpoint.layout import FORMAT_VERSION
from shardwise.checkpoint.locate import resolve
from shardwise.checkpoint.manifest import Manifest, Piece, TensorRecord
from shardwise.checkpoint.reader import CheckpointReader, find_latest_valid
from shardwise.checkpoint.shards import ShardEntry
from shardwise.checkpoint.tools import export_consolidated, inspect, verify_cli
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
    "export_consolidated",
    "find_latest_valid",
    "inspect",
    "resolve",
    "save_checkpoint",
    "verify",
    "verify_cli",
]

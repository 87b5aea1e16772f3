"""shardwise's communication layer: the only code that calls torch.distributed collectives.

The names here are the public facade (``group=None`` means the current world). Library code
calls ``ops``, ``objects`` and ``mpi_split`` with an explicit group.
"""

from shardwise.comm.algorithms import ALGORITHMS
from shardwise.comm.current_world import current, resolve
from shardwise.comm.dispatch import Handle
from shardwise.comm.facade import (
    all_gather,
    all_gather_list,
    all_gather_object,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    barrier,
    broadcast,
    broadcast_object,
    comm_stats,
    exposed_comm_seconds,
    new_group,
    recv,
    reduce_scatter,
    send,
    set_debug,
    split,
    world,
)
from shardwise.comm.groups import Group, World
from shardwise.comm.ops import chunk_sizes
from shardwise.comm.signatures import GroupLike
from shardwise.comm.stats import CommStats
from shardwise.comm.trace import CollectiveError, CollectiveTimeoutError, DesyncError

__all__ = [
    "ALGORITHMS",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommStats",
    "DesyncError",
    "Group",
    "GroupLike",
    "Handle",
    "World",
    "all_gather",
    "all_gather_list",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object",
    "chunk_sizes",
    "comm_stats",
    "current",
    "exposed_comm_seconds",
    "new_group",
    "recv",
    "reduce_scatter",
    "resolve",
    "send",
    "set_debug",
    "split",
    "world",
]

"""shardwise's communication layer: the only code that calls torch.distributed collectives."""

from shardwise.comm.algorithms import ALGORITHMS, all_reduce
from shardwise.comm.groups import Group, new_group, resolve, split, world
from shardwise.comm.ops import (
    Handle,
    all_gather,
    all_gather_list,
    all_gather_object,
    all_reduce_coalesced,
    barrier,
    broadcast,
    broadcast_object,
    chunk_sizes,
    recv,
    reduce_scatter,
    send,
)
from shardwise.comm.stats import STATS, comm_stats, exposed_comm_seconds
from shardwise.comm.trace import (
    CollectiveError,
    CollectiveTimeoutError,
    DesyncError,
    set_debug,
)

__all__ = [
    "ALGORITHMS",
    "STATS",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DesyncError",
    "Group",
    "Handle",
    "all_gather",
    "all_gather_list",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "broadcast",
    "broadcast_object",
    "chunk_sizes",
    "comm_stats",
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

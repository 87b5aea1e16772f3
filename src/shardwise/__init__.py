"""shardwise: ZeRO-sharded, fault-tolerant distributed training for PyTorch models."""

from shardwise.comm import (
    CollectiveError,
    CollectiveTimeoutError,
    DesyncError,
    Group,
    all_gather,
    all_gather_list,
    all_reduce,
    all_reduce_coalesced,
    broadcast,
    comm_stats,
    new_group,
    recv,
    reduce_scatter,
    send,
    split,
)
from shardwise.config import Config
from shardwise.dist import (
    DistInitError,
    barrier,
    device,
    init,
    local_rank,
    rank,
    shutdown,
    world_size,
)
from shardwise.engine import Engine, initialize
from shardwise.mesh import Mesh
from shardwise.recompute import checkpoint, checkpoint_sequential
from shardwise.zero.wrap import ZeroOptimizer, zero_wrap

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "Config",
    "DesyncError",
    "DistInitError",
    "Engine",
    "Group",
    "Mesh",
    "ZeroOptimizer",
    "__version__",
    "all_gather",
    "all_gather_list",
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "broadcast",
    "checkpoint",
    "checkpoint_sequential",
    "comm_stats",
    "device",
    "init",
    "initialize",
    "local_rank",
    "new_group",
    "rank",
    "recv",
    "reduce_scatter",
    "send",
    "shutdown",
    "split",
    "world_size",
    "zero_wrap",
]

"""shardwise: ZeRO-sharded, fault-tolerant distributed training for PyTorch models.

``import shardwise`` makes every public subpackage available: ``comm``, ``costmodel``,
``data``, ``engine``, ``models``, ``parallel`` (``parallel.tensor``, ``parallel.pipeline``,
``parallel.plans``), ``recompute``, ``topology``, ``zero`` (the checkpoint format lives in
``shardwise.checkpoint_format``; ``shardwise.checkpoint`` is activation checkpointing).
"""

from pathlib import Path
from typing import Any

from shardwise import checkpoint as checkpoint_format
from shardwise import (
    comm,
    costmodel,
    data,
    engine,
    models,
    parallel,
    recompute,
    topology,
    zero,
)
from shardwise.comm import (
    CollectiveError,
    CollectiveTimeoutError,
    DesyncError,
    Group,
    World,
    all_gather,
    all_gather_list,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    broadcast,
    comm_stats,
    new_group,
    recv,
    reduce_scatter,
    send,
    split,
)
from shardwise.comm import links as comm_links
from shardwise.comm.current_world import (
    barrier,
    device,
    init,
    local_rank,
    rank,
    shutdown,
    world_size,
)
from shardwise.config import Config
from shardwise.dist import DistInitError
from shardwise.engine import Engine, deferred_init, initialize, load_pretrained
from shardwise.mesh import Axis, Mesh
from shardwise.parallel import ContextPlan, Parallelized, ParallelPlan, PipelineSplit, parallelize
from shardwise.recompute import checkpoint, checkpoint_sequential
from shardwise.seeding import seed_all
from shardwise.topology import discover
from shardwise.zero.wrap import ZeroOptimizer, zero_wrap

# The public all_reduce's algorithm="auto" measures a group's links with topology's discover,
# which is built on comm: the package hands it to comm here rather than comm importing it.
comm_links.use_discovery(discover)

__version__ = "0.1.0"


def finetune(model_dir: str | Path, data: str | Path, **options: Any) -> Path:
    """Fine-tune the Hugging Face model in ``model_dir`` on ``data`` (JSONL or JSON) as
    ``shardwise finetune MODEL_DIR --data DATA`` does: local ranks launched, waited for, and
    the run directory returned. Each keyword is one of the command's options
    (``lora="r=8,targets=q_proj,v_proj"``, ``steps=20``, ``packing=True``, ``run_dir=...``;
    True for a flag, None or False to leave it out). The pieces for a loop of one's own are
    in ``shardwise.sft``.

    Raises:
        ValueError: bad input (the command's one line), or the run failing.
    """
    # The command lives in the app; the facade reaches it only when called, so importing
    # the library never imports the app (tests/unit/test_import_graph.py allows this edge).
    from shardwise.cli.finetune_cmd import finetune as run

    return run(model_dir, data, **options)


__all__ = [
    "Axis",
    "CollectiveError",
    "CollectiveTimeoutError",
    "Config",
    "ContextPlan",
    "DesyncError",
    "DistInitError",
    "Engine",
    "Group",
    "Mesh",
    "ParallelPlan",
    "Parallelized",
    "PipelineSplit",
    "World",
    "ZeroOptimizer",
    "__version__",
    "all_gather",
    "all_gather_list",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "barrier",
    "broadcast",
    "checkpoint",
    "checkpoint_format",
    "checkpoint_sequential",
    "comm",
    "comm_stats",
    "costmodel",
    "data",
    "deferred_init",
    "device",
    "engine",
    "finetune",
    "init",
    "initialize",
    "load_pretrained",
    "local_rank",
    "models",
    "new_group",
    "parallel",
    "parallelize",
    "rank",
    "recompute",
    "recv",
    "reduce_scatter",
    "seed_all",
    "send",
    "shutdown",
    "split",
    "topology",
    "world_size",
    "zero",
    "zero_wrap",
]

"""The training engine: ZeRO sharding, precision, the optimizer over shards, checkpoints.

``Engine`` composes them (``core``); ``build`` makes its parts, ``run_state`` and
``checkpoint`` save and load it, ``weights`` moves full weights in and out, ``memory`` reports
what it holds, ``param_access`` reads and writes whole parameters behind the shards;
``materialize`` starts a model built on the meta device, ``pretrained`` streams a checkpoint
in, each rank reading what it keeps (``targets``: where that goes).
``initialize`` picks the engine for a model (a ``PipelineModule`` gets ``pipeline``'s engine).
"""

from shardwise.deferred import deferred_init
from shardwise.engine.core import Engine, SchedulerFactory
from shardwise.engine.initialize import initialize
from shardwise.engine.pretrained import load_pretrained

__all__ = ["Engine", "SchedulerFactory", "deferred_init", "initialize", "load_pretrained"]

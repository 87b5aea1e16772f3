"""Tensor and sequence parallelism over a mesh's ``tp`` axis (Megatron-LM style).

    tp = shardwise.tp.parallelize(model, mesh, shardwise.models.gpt.tp_plan(),
                                  sequence_parallel=True)
    loss = model(x, y); loss.backward(); optimizer.step()

Parallel layers are explicit autograd functions over ``shardwise.comm``: every byte is counted.
"""

from shardwise.tp import plans, rng
from shardwise.tp.cross_entropy import vocab_parallel_cross_entropy
from shardwise.tp.layers import (
    ColumnParallelLinear,
    Region,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardwise.tp.parallelize import TensorParallel, parallelize
from shardwise.tp.placement import TPPlacement
from shardwise.tp.plan import STYLES

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "Region",
    "RowParallelLinear",
    "TPPlacement",
    "TensorParallel",
    "VocabParallelEmbedding",
    "parallelize",
    "plans",
    "rng",
    "vocab_parallel_cross_entropy",
]

"""Tensor and sequence parallelism over a mesh's ``tp`` axis (Megatron-LM style).

    tp = shardwise.parallel.tensor.parallelize(
        model, mesh, shardwise.parallel.plans.gpt.tp_plan(), sequence_parallel=True
    )
    engine = shardwise.initialize(model, optimizer, config, group=mesh,
                                  placements=tp.placements)

Parallel layers are explicit autograd functions over ``shardwise.comm``: every byte is counted.
"""

from shardwise.parallel.tensor import rng
from shardwise.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from shardwise.parallel.tensor.layers import (
    ColumnParallelLinear,
    Region,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardwise.parallel.tensor.parallelize import TensorParallel, parallelize
from shardwise.parallel.tensor.plan import STYLES

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "Region",
    "RowParallelLinear",
    "TensorParallel",
    "VocabParallelEmbedding",
    "parallelize",
    "rng",
    "vocab_parallel_cross_entropy",
]

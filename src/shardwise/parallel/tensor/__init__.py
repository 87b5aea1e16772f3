"""Tensor and sequence parallelism over a mesh's ``tp`` axis (Megatron-LM style).

    tp = shardwise.parallel.tensor.parallelize(model, mesh, shardwise.models.gpt.tp_plan(),
                                  sequence_parallel=True)
    loss = model(x, y); loss.backward(); optimizer.step()

Parallel layers are explicit autograd functions over ``shardwise.comm``: every byte is counted.
"""

from shardwise.parallel.tensor import plans, rng
from shardwise.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from shardwise.parallel.tensor.layers import (
    ColumnParallelLinear,
    Region,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardwise.parallel.tensor.parallelize import TensorParallel, parallelize
from shardwise.parallel.tensor.placement import TPPlacement
from shardwise.parallel.tensor.plan import STYLES

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

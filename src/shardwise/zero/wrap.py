"""``zero_wrap``: ZeRO stage 1 or 2 for an ordinary model, without the engine.

opt = shardwise.zero_wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
loss = model(x).sum(); loss.backward()   # local gradients, as usual
opt.step()                               # reduce_scatter, sharded update, all_gather
opt.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.comm.groups import Group
from shardwise.config import MiB
from shardwise.precision import DynamicLossScaler
from shardwise.zero import optimizer as zero_opt
from shardwise.zero.flat_param import Dtypes, FlatParam
from shardwise.zero.reducer import GradReducer
from shardwise.zero.stage import ZeroStage
from shardwise.zero.step import sharded_step, zero_grads
from shardwise.zero.units import fill_buckets


class ZeroOptimizer:
    """Wraps a torch optimizer so each rank keeps states for and updates only its shard.

    The wrapped optimizer's parameters become views into flat padded buffers (their values are
    rank 0's from here on); their gradients, computed locally, are averaged over ``group`` by
    ``step()``. Stage 2 keeps only the reduced gradient shard after the reduction.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stage: int,
        group: Group,
        bucket_bytes: int = 16 * MiB,
        clip: float | None = None,
        allow_untested_optimizer: bool = False,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"zero_wrap supports stages 1 and 2 (stage 3 needs the model: use "
                f"shardwise.initialize), got {stage!r}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"zero_wrap needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        zero_opt.check_shardable(type(optimizer), allow_untested_optimizer)
        self.group = group
        self.clip = clip
        params: list[nn.Parameter] = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad and all(p is not q for q in params):
                    params.append(p)
        if not params:
            raise ValueError("the optimizer holds no trainable parameters")
        zstage = ZeroStage.of(stage)
        self.flats = []
        # reverse order: roughly the order gradients become ready
        ordered = [(f"param{i}", params[i]) for i in reversed(range(len(params)))]
        for named in fill_buckets(ordered, bucket_bytes):
            f = FlatParam(named, self.group, zstage, Dtypes())
            f.broadcast_from(self.group.ranks[0])
            f.finish_init()
            self.flats.append(f)
        shard_of = {
            id(f.params[f.slots.index(pc.slot)]): op
            for f in self.flats
            for pc, op in zip(f.opt_pieces, f.opt_params)
        }
        self.optimizer = zero_opt.rebuild(optimizer, params, shard_of, allow_untested_optimizer)
        self.reducer = GradReducer(self.flats)
        self.scaler = DynamicLossScaler(enabled=False)
        self.grad_norm: float | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> bool:
        """Average the gradients over the group, update this rank's shard, gather the updated
        parameters. Communicates: reduce_scatter and all_gather of every flat buffer, one
        4-byte all_reduce for the gradient norm."""
        self.reducer.reduce_all()
        result = sharded_step(self.flats, self.optimizer, self.scaler, self.clip)
        self.grad_norm = result.grad_norm
        return result.updated

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.flats)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state."""
        return self.optimizer.state_dict()


def zero_wrap(
    optimizer: torch.optim.Optimizer, stage: int, group: Group | None = None, **kwargs: Any
) -> ZeroOptimizer:
    """An optimizer whose ``step()`` performs the ZeRO stage 1 or 2 sharded update over
    ``group`` (default: the world) for a model whose gradients were computed locally."""
    return ZeroOptimizer(optimizer, stage, group=comm.resolve(group), **kwargs)

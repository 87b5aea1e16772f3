"""The user's optimizer, rebuilt over this rank's parameter shards.

An element-wise optimizer (each element's update reads only that element's gradient and state)
gives the same result on any partition of the parameters, which is what lets ZeRO shard its
states (ZeRO paper, section 5.1). Its class, hyperparameters and parameter groups are kept; each
group's parameters are replaced by the pieces of them this rank owns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

ELEMENTWISE = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adadelta",
    "Rprop",
    "ASGD",
)
NOT_ELEMENTWISE = {
    "LBFGS": "needs the whole parameter vector and a closure",
    "Adafactor": "factors second moments over rows and columns",
    "SparseAdam": "works on sparse gradients",
    "Muon": "orthogonalizes whole matrices",
    "Shampoo": "preconditions whole matrices",
    "LAMB": "scales updates by whole-tensor norms",
    "LARS": "scales updates by whole-tensor norms",
}

OptimizerLike = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def check_shardable(opt_class: type, allow_untested: bool) -> None:
    name = opt_class.__name__
    if name in NOT_ELEMENTWISE:
        raise ValueError(
            f"optimizer {name} cannot be sharded by ZeRO: it "
            f"{NOT_ELEMENTWISE[name]}. Element-wise optimizers work: "
            f"{', '.join(ELEMENTWISE)}"
        )
    if name not in ELEMENTWISE and not allow_untested:
        raise ValueError(
            f"optimizer {name} is not known to be element-wise, so sharding it may "
            f"train wrongly. Known: {', '.join(ELEMENTWISE)}; set "
            f"Config(allow_untested_optimizer=True) if {name} is element-wise"
        )


def _construct(
    cls: type, groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> torch.optim.Optimizer:
    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    return cls(groups, **kwargs)


def rebuild(
    optimizer: OptimizerLike,
    model_params: Iterable[nn.Parameter],
    shard_of: dict[int, nn.Parameter],
    allow_untested: bool,
) -> torch.optim.Optimizer:
    """An optimizer of the same kind over the shard parameters.

    Args:
        optimizer: an optimizer built over the model's parameters, or a callable that builds one
            from a list of parameters.
        model_params: the model's parameters, in order.
        shard_of: id(model parameter) -> this rank's piece of it (absent: no piece here).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        check_shardable(type(optimizer), allow_untested)
        known = {id(p) for p in model_params}
        groups = []
        for g in optimizer.param_groups:
            strangers = [p for p in g["params"] if id(p) not in known]
            if strangers:
                raise ValueError(
                    f"the optimizer holds {len(strangers)} tensor(s) that are not "
                    f"parameters of the model; build it over model.parameters()"
                )
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append(
                {"params": [shard_of[id(p)] for p in g["params"] if id(p) in shard_of], **hyper}
            )
        if not any(g["params"] for g in groups):  # this rank owns no piece (tiny model)
            groups[0]["params"] = [nn.Parameter(torch.zeros(0))]
        return _construct(type(optimizer), groups, optimizer.defaults)
    if callable(optimizer):
        params = [shard_of[id(p)] for p in model_params if id(p) in shard_of]
        built = optimizer(params or [nn.Parameter(torch.zeros(0))])
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer factory returned {type(built).__name__}, "
                f"not a torch.optim.Optimizer"
            )
        check_shardable(type(built), allow_untested)
        return built
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer or a callable params -> "
        f"optimizer, got {type(optimizer).__name__}"
    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (each storage counted once)."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                st = v.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())

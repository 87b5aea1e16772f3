"""Per-parameter placement: a parameter split by hand over a group that is not the dp group.

World 4 = dp2 x tp2. The first layer's weight and bias are split by rows over tp (each tp rank
holds half of the hidden units, the activations are all-gathered over tp in forward); the second
layer is replicated over tp. The engine shards everything over dp (ZeRO) and must count the
split layer once over tp, the replicated one once, so its gradient norm, clipping and update
equal a single process training the whole model on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.mesh import Axis
from shardwise.parallel.placement import Placement, Replicate, Shard
from shardwise.testing import run_on_ranks

D_IN, HIDDEN, D_OUT, MICRO, STEPS, CLIP, LR = 8, 16, 4, 3, 3, 0.05, 0.1


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)
        self.tp: shardwise.Group | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))  # [batch, HIDDEN // tp_size]
        if self.tp is not None:
            h = _GatherColumns.apply(h, self.tp)  # [batch, HIDDEN]
        return nn.functional.mse_loss(self.fc2(h), y)


class _GatherColumns(torch.autograd.Function):
    """Forward: concatenate the tp ranks' column blocks; backward: this rank's block of the
    (tp-identical) gradient."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, group: shardwise.Group) -> torch.Tensor:
        ctx.group = group
        return shardwise.all_gather(h.t().contiguous(), group=group).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = grad.shape[1] // ctx.group.size
        return grad[:, ctx.group.rank * n : (ctx.group.rank + 1) * n], None


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP()


def _batches(parts: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    return [
        [
            (torch.randn(MICRO, D_IN, generator=g), torch.randn(MICRO, D_OUT, generator=g))
            for _ in range(parts)
        ]
        for _ in range(STEPS)
    ]


def _reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    norms = []
    for parts in _batches(dp):
        for x, y in parts:
            (model(x, y) / len(parts)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _split_rows(model: MLP, mesh: shardwise.Mesh) -> dict[str, Placement]:
    """What a column-parallel layer does: keep this rank's rows; their placements say so."""
    tp = mesh.group(Axis.TP)
    placements = {}
    for name in ("weight", "bias"):
        full = getattr(model.fc1, name)
        placements[f"fc1.{name}"] = Placement.on(mesh, f"fc1.{name}", full.shape, {"tp": Shard(0)})
        piece = nn.Parameter(full.detach().chunk(tp.size, dim=0)[tp.rank].clone())
        setattr(model.fc1, name, piece)
    model.tp = tp
    return placements


def _train_task(stage: int, mark: bool):
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(dp=2, tp=2)
    model = _model()
    placements = _split_rows(model, mesh)
    if not mark:  # claim fc1 is replicated: its halves then look like a whole (4, 8) tensor
        placements = {
            n: Placement.on(mesh, n, getattr(model.fc1, n[4:]).shape, {}) for n in placements
        }
    cfg = shardwise.Config(zero_stage=stage, gradient_clipping=CLIP)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = shardwise.initialize(model, opt, cfg, group=mesh, placements=placements)
    if mark:
        _check_placements(
            mesh.coords, engine.placement(model.fc1.weight), engine.placement(model.fc2.weight)
        )
    norms = []
    for parts in _batches(mesh.dp_size):
        x, y = parts[mesh.rank("dp")]
        engine.backward(engine(x, y))
        assert engine.step()
        norms.append(engine.grad_norm)
    state = engine.state_dict()
    return mesh.coords, norms, state


def _check_placements(coords, fc1, fc2) -> None:
    assert [(a.axis, a.style) for a in fc1.shards] == [(Axis.TP, Shard(0))]
    assert fc1.full_shape == (HIDDEN, D_IN) and fc1.local_shape() == (HIDDEN // 2, D_IN)
    assert fc1.real_box()[0] == (coords["tp"] * HIDDEN // 2, 0)
    assert fc2.shards == () and Axis.TP in fc2.copies and fc2.style("tp") == Replicate()
    assert Axis.TP not in fc1.copies


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_tp_split_parameter_norm_and_clipped_update_match_one_process(stage):
    ref_norms, ref_state = _reference(dp=2)
    assert min(ref_norms) > CLIP  # clipping is active on every step
    for _, norms, state in run_on_ranks(4, _train_task, stage, True):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        # engine.state_dict() gathers the split fc1 whole over tp
        torch.testing.assert_close(state["fc1.weight"], ref_state["fc1.weight"])
        torch.testing.assert_close(state["fc1.bias"], ref_state["fc1.bias"])
        torch.testing.assert_close(state["fc2.weight"], ref_state["fc2.weight"])
        torch.testing.assert_close(state["fc2.bias"], ref_state["fc2.bias"])


def test_unmarked_split_parameter_gives_a_different_norm():
    """The same run without the placement counts only half of fc1's squares: the test above
    depends on the placement."""
    ref_norms, _ = _reference(dp=2)
    for _, norms, _ in run_on_ranks(4, _train_task, 1, False):
        assert abs(norms[0] - ref_norms[0]) > 1e-3 * ref_norms[0]


def _bad_placements_task():
    mesh = shardwise.Mesh(dp=2, tp=2)
    errors = []
    for call in (
        lambda: Placement.on(mesh, "w", (4, 2), {"tp": Shard(2)}),
        lambda: Placement.on(mesh, "w", (4, 2), {"ep": Shard(0)}),
    ):
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        errors.append(str(info.value))
    vocab = Placement.on(mesh, "emb", (15, 4), {"tp": Shard(0)})  # 15 rows padded to 2 x 8
    assert vocab.local_shape() == (8, 4) and vocab.padded
    assert vocab.real_box() == ((8 * mesh.rank("tp"), 0), (8 - mesh.rank("tp"), 4))
    # a model split by hand whose placements are not given is refused, naming the parameter
    model = _model()
    _split_rows(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrong = {"fc1.weight": Placement.on(mesh, "fc1.weight", (HIDDEN, D_IN), {"tp": Shard(1)})}
    with pytest.raises(ValueError, match=r"parameter 'fc1\.weight' has shape") as info:
        shardwise.initialize(model, opt, group=mesh, placements=wrong)
    errors.append(str(info.value))
    return errors


def test_bad_placements_are_refused():
    for errors in run_on_ranks(4, _bad_placements_task):
        assert "w: Shard(dim=2) over tp is out of range for shape (4, 2)" in errors[0]
        assert "unknown mesh axis 'ep'" in errors[1]
        assert "(8, 8)" in errors[2] and "(16, 4)" in errors[2]


def _unplanned_tp_layers_task():
    from shardwise.parallel import plans
    from shardwise.parallel import tensor as swtp

    mesh = shardwise.Mesh(dp=2, tp=2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    swtp.parallelize(model, mesh, {"0": "colwise", "1": "rowwise"})
    with pytest.raises(ValueError, match="'0' is a tensor-parallel ColumnParallelLinear") as info:
        shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), group=mesh)
    assert plans.gpt.tp_plan()  # the recipes are reachable from the package
    return str(info.value)


def test_a_tensor_parallel_model_without_its_placements_is_refused():
    for message in run_on_ranks(4, _unplanned_tp_layers_task):
        assert "pass what parallelize returned" in message

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
from shardwise.parallel.placement import Shard, mark_sharded, placement_of, unmark
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


def _split_rows(model: MLP, tp: shardwise.Group) -> None:
    """What a column-parallel layer does: keep this rank's rows, mark them split over tp."""
    for name in ("weight", "bias"):
        full = getattr(model.fc1, name)
        piece = nn.Parameter(full.detach().chunk(tp.size, dim=0)[tp.rank].clone())
        setattr(model.fc1, name, piece)
        mark_sharded(piece, tp, dim=0)
    model.tp = tp


def _train_task(stage: int, mark: bool):
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(dp=2, tp=2)
    tp = mesh.group("tp")
    model = _model()
    _split_rows(model, tp)
    if not mark:
        unmark(model.fc1.weight)
        unmark(model.fc1.bias)
    cfg = shardwise.Config(zero_stage=stage, gradient_clipping=CLIP)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = shardwise.initialize(model, opt, cfg, group=mesh)
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
    assert [s.dim for s in fc1.shards] == [0] and fc1.shards[0].group.name == "tp"
    assert fc1.full_shape((HIDDEN // 2, D_IN)) == (HIDDEN, D_IN)
    assert fc1.offsets((HIDDEN // 2, D_IN)) == (coords["tp"] * HIDDEN // 2, 0)
    assert fc2.shards == () and "tp" in [g.name for g in fc2.replicated]
    assert all(g.name != "tp" for g in fc1.replicated)


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


def _bad_marks_task():
    mesh = shardwise.Mesh(dp=2, tp=2)
    p = nn.Parameter(torch.zeros(4, 2))
    errors = []
    for call in (
        lambda: mark_sharded(p, mesh.group("tp"), dim=2),
        lambda: mark_sharded(torch.zeros(2), "tp", dim=0),
        lambda: mark_sharded(p, mesh.group("tp"), dim=True),
    ):
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        errors.append(str(info.value))
    mark_sharded(p, mesh.group("tp"), dim=1)
    mark_sharded(p, mesh.group("tp"), dim=-2)  # marking the same group again replaces the dim
    assert placement_of(p).shards == (Shard(mesh.group("tp"), 0),)
    vocab = nn.Parameter(torch.zeros(8, 4))  # 15 rows padded to 2 x 8
    padded = mark_sharded(vocab, mesh.group("tp"), dim=0, full_size=15)
    assert padded.full_shape((8, 4)) == (15, 4)
    assert padded.offsets((8, 4)) == (8 * mesh.rank("tp"), 0)
    with pytest.raises(ValueError, match=r"full_size=17 must be an int in \[1, 16\]"):
        mark_sharded(vocab, mesh.group("tp"), dim=0, full_size=17)
    model = _model()
    mark_sharded(model.fc1.weight, mesh.group("dp", "tp"), dim=0)  # overlaps dp: refused
    with pytest.raises(ValueError, match="shares ranks with the data-parallel group"):
        shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), group=mesh)
    return errors


def test_bad_marks_are_refused():
    for errors in run_on_ranks(4, _bad_marks_task):
        assert "dim=2 is out of range for a parameter of shape (4, 2)" in errors[0]
        assert "needs a shardwise.Group, got str" in errors[1]
        assert "dim=True" in errors[2]

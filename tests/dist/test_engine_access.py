"""The engine's edges: buffers, backward from received gradients, full parameters at ZeRO-3,
a model given twice, ranks with different models, non-finite gradients."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import shardwise
from shardwise.recompute import apply_activation_checkpointing
from shardwise.testing import run_on_ranks


class Net(nn.Module):
    """Two layers and a non-contiguous buffer (a transposed view)."""

    def __init__(self, buffer_offset: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)
        base = torch.arange(6.0).view(2, 3) + buffer_offset
        self.register_buffer("table", base.t())  # [3, 2], strides (1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _net(offset: float = 0.0) -> Net:
    torch.manual_seed(0)
    return Net(offset)


def _data(parts: int, steps: int = 2) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    return [
        [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(parts)]
        for _ in range(steps)
    ]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ---- buffers ----


def _buffer_task():
    model = _net(offset=100.0 * shardwise.rank())
    assert not model.table.is_contiguous()
    shardwise.initialize(model, _sgd(model))
    return model.table.clone(), model.table.is_contiguous()


def test_non_contiguous_buffer_gets_rank0_values():
    expected = (torch.arange(6.0).view(2, 3)).t()
    for table, contiguous in run_on_ranks(2, _buffer_task):
        assert torch.equal(table, expected) and not contiguous


# ---- backward from a received gradient ----


def _reference_first_stage(parts: int, clip: float) -> tuple[list[float], dict]:
    model = _net()
    opt = torch.optim.SGD(model.fc1.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for batch in _data(parts):
        for x, y in batch:
            (nn.functional.mse_loss(model(x), y) / len(batch)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.fc1.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.clone() for k, v in model.fc1.state_dict().items()}


def _first_stage_task(stage: int, clip: float):
    """fc1 is a pipeline stage that is not the last: its engine backpropagates the gradient
    of its output that the next stage (fc2 and the loss, run here without an engine) sends."""
    torch.set_num_threads(1)
    n, r = shardwise.world_size(), shardwise.rank()
    full = _net()
    engine = shardwise.initialize(
        full.fc1, _sgd(full.fc1), shardwise.Config(zero_stage=stage, gradient_clipping=clip)
    )
    for batch in _data(n):
        x, y = batch[r]
        h = engine(x)
        received = torch.tanh(h).detach().requires_grad_()  # what the next stage gets
        loss = nn.functional.mse_loss(full.fc2(received), y)
        (grad,) = torch.autograd.grad(loss, received)
        engine.backward(torch.tanh(h), grad)
        assert engine.step()
    bad = []
    for args in ((engine(x),), (engine(x), grad[:1]), (engine(x).detach(), torch.ones(3, 8))):
        with pytest.raises(ValueError) as info:
            engine.backward(*args)
        bad.append(str(info.value))
    return engine.grad_norm, engine.state_dict(), bad


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_backward_from_received_gradient_matches_one_process(stage):
    clip = 0.05
    norms, ref = _reference_first_stage(2, clip)
    assert norms[-1] > clip
    for norm, state, bad in run_on_ranks(2, _first_stage_task, stage, clip):
        assert norm == pytest.approx(norms[-1], rel=1e-5)
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v)
        assert "backward needs a scalar loss, got shape (3, 8); pass grad_tensors" in bad[0]
        assert "grad_tensors[0] must be a tensor of shape (3, 8), got (1, 8)" in bad[1]
        assert "tensors[0] does not require grad" in bad[2]


def _reference_whole(clip: float) -> tuple[list[float], dict]:
    model = _net()
    opt = _sgd(model)
    norms = []
    for batch in _data(1):
        x, y = batch[0]
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.clone() for k, v in model.state_dict().items() if k != "table"}


def _pipeline_task(stage: int, clip: float):
    """Two pipeline stages on a pp=2 mesh: fc1 on rank 0, fc2 and the loss on rank 1; the
    activations and their gradients travel by send/recv."""
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(pp=2, dp=1)
    pp, first = mesh.group("pp"), mesh.rank("pp") == 0
    full = _net()
    part = full.fc1 if first else full.fc2
    cfg = shardwise.Config(zero_stage=stage, gradient_clipping=clip)
    engine = shardwise.initialize(part, _sgd(part), cfg, group=mesh)
    for batch in _data(1):
        x, y = batch[0]
        if first:
            h = torch.tanh(engine(x))
            shardwise.send(h.detach().contiguous(), dst=1, group=pp)
            grad = torch.empty_like(h)
            shardwise.recv(grad, src=1, group=pp)
            engine.backward(h, grad)
        else:
            h = torch.empty(x.shape[0], 8)
            shardwise.recv(h, src=0, group=pp)
            h.requires_grad_()
            engine.backward(nn.functional.mse_loss(engine(h), y))
            shardwise.send(h.grad, dst=0, group=pp)
        assert engine.step()
    prefix = "fc1." if first else "fc2."
    return engine.grad_norm, {prefix + k: v for k, v in engine.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 3])
def test_two_stage_pipeline_matches_one_process(stage):
    """The norm sums over pp (each stage holds its own layers): clipping and the update of
    both stages equal one process training the whole model."""
    clip = 0.05
    norms, ref = _reference_whole(clip)
    assert min(norms) > clip
    states = {}
    for norm, state in run_on_ranks(2, _pipeline_task, stage, clip):
        assert norm == pytest.approx(norms[-1], rel=1e-5)
        states.update(state)
    assert sorted(states) == sorted(ref)
    for k, v in ref.items():
        torch.testing.assert_close(states[k], v)


def _recompute_task(outside: bool):
    torch.set_num_threads(1)
    from zero_cases import batches, make_gpt

    model = make_gpt()
    cfg = shardwise.Config(zero_stage=3)
    if outside:
        apply_activation_checkpointing(model, ["Block"])
    else:
        cfg = cfg.replace(activation_checkpointing=["Block"])
    engine = shardwise.initialize(model, _sgd(model), cfg)
    calls = []
    for m in model.modules():
        if type(m).__name__ == "Block":
            m.register_forward_hook(lambda *_: calls.append(1))
    x, y = batches("gpt", 1, 1)[0][0]
    engine.backward(engine(x, y))
    engine.step()
    return engine.state_dict(), len(calls)


def test_recompute_applied_outside_equals_the_config_path():
    """Both run every Block's forward twice (forward, then recompute in backward) and train
    to the same bits."""
    from zero_cases import GPT_CFG

    outside = run_on_ranks(2, _recompute_task, True)
    inside = run_on_ranks(2, _recompute_task, False)
    for (a, calls_a), (b, calls_b) in zip(outside, inside):
        assert calls_a == calls_b == 2 * GPT_CFG.n_layer
        assert all(torch.equal(a[k], b[k]) for k in a)


# ---- full parameters at ZeRO-3 ----


def _access_task(stage: int):
    torch.set_num_threads(1)
    model = _net()
    engine = shardwise.initialize(model, _sgd(model), shardwise.Config(zero_stage=stage))
    out: dict = {}
    w = model.fc1.weight
    out["shape"], out["numel"], out["dtype"] = tuple(w.shape), w.numel(), w.dtype
    reads = {
        "sum": lambda: w.sum(),
        "clone": lambda: w.clone(),
        "data": lambda: w.data,
        "matmul": lambda: torch.ones(3, 4) @ w.t(),
        "cat": lambda: torch.cat([w, w]),
        "deepcopy": lambda: copy.deepcopy(model),
    }
    out["reads"] = {}
    for what, read in reads.items():
        try:
            got = read()
            out["reads"][what] = "copied" if what == "deepcopy" else tuple(got.shape)
        except RuntimeError as e:
            out["reads"][what] = str(e)
    out["repr"] = repr(w)
    try:
        model.state_dict()
        out["sd_error"] = None
    except RuntimeError as e:
        out["sd_error"] = str(e)
    try:
        model.fc2.state_dict()
        out["sub_sd_error"] = None
    except RuntimeError as e:
        out["sub_sd_error"] = str(e)
    with engine.gathered_parameters():
        out["gathered"] = {k: v.clone() for k, v in model.state_dict().items()}
    with engine.gathered_parameters([model.fc2.weight], modifier_rank=1):
        if shardwise.rank() == 1:
            with torch.no_grad():
                model.fc2.weight.fill_(0.5)
    out["after"] = engine.state_dict()
    x, y = _data(1)[0][0]
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    out["trained"] = engine.step()
    out["forward_inside"] = ""
    try:
        with engine.gathered_parameters(modifier_rank=0):
            engine(x)
    except RuntimeError as e:
        out["forward_inside"] = str(e)
    out["twice"] = ""
    try:
        shardwise.initialize(model, _sgd(model), shardwise.Config(zero_stage=stage))
    except ValueError as e:
        out["twice"] = str(e)
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_full_parameters_through_gathered_parameters(stage):
    ref = _net().state_dict()
    for out in run_on_ranks(2, _access_task, stage):
        assert (out["shape"], out["numel"], out["dtype"]) == ((8, 4), 32, torch.float32)
        if stage == 3:
            # the values live in shards: every read of them raises, naming the parameter
            for what, got in out["reads"].items():
                assert isinstance(got, str), what
                assert got.startswith("parameter 'fc1.weight' is sharded (ZeRO stage 3)"), got
                assert "engine.gathered_parameters()" in got
            assert "(reading .data needs them)" in out["reads"]["data"]
            assert "(sum() needs them)" in out["reads"]["sum"]
            assert "ShardedParameter('fc1.weight', shape=(8, 4)" in out["repr"]
            assert "sharded again inside gathered_parameters" in out["forward_inside"]
            for key in ("sd_error", "sub_sd_error"):
                assert "sharded (ZeRO stage 3)" in out[key]
                assert "engine.gathered_parameters()" in out[key]
        else:
            assert out["sd_error"] is None
            assert out["reads"]["clone"] == (8, 4) and out["reads"]["deepcopy"] == "copied"
        for k, v in ref.items():
            assert torch.equal(out["gathered"][k], v), k
        for k, v in ref.items():
            want = torch.full_like(v, 0.5) if k == "fc2.weight" else v
            assert torch.equal(out["after"][k], want), k
        assert out["trained"]
        assert "'fc1.weight' was already given to shardwise.initialize" in out["twice"]


# ---- ranks with different models ----


def _mismatch_task():
    torch.manual_seed(0)
    if shardwise.rank() == 0:
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    with pytest.raises(ValueError) as info:
        shardwise.initialize(model, _sgd(model))
    return str(info.value)


def test_ranks_with_different_models_are_refused_naming_the_difference():
    for message in run_on_ranks(2, _mismatch_task):
        assert "parameter #2 is 1.weight [2, 8] torch.float32 on rank 0 but 1.weight [3, 8]" in (
            message
        )


# ---- non-finite gradients ----


def _nonfinite_task(stage: int, mode: str):
    torch.set_num_threads(1)
    model = _net()
    cfg = shardwise.Config(zero_stage=stage, nonfinite_grads=mode)
    engine = shardwise.initialize(model, _sgd(model), cfg)
    before = engine.state_dict()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardwise").addHandler(handler)
    x, y = _data(1)[0][0]
    if shardwise.rank() == 1:
        x = x.clone()
        x[0, 0] = float("nan")
    engine.backward(nn.functional.mse_loss(engine(x), y))
    try:
        result: object = engine.step()
    except FloatingPointError as e:
        result = str(e)
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    unchanged = all(torch.equal(v, engine.state_dict()[k]) for k, v in before.items())
    x, y = _data(1)[0][0]
    engine.backward(nn.functional.mse_loss(engine(x), y))
    return result, unchanged, engine.skipped_steps, records, engine.step()


@pytest.mark.parametrize("stage", [0, 2])
def test_nonfinite_gradients_skip_the_step_with_a_warning(stage):
    for result, unchanged, skipped, records, next_ok in run_on_ranks(
        2, _nonfinite_task, stage, "skip"
    ):
        assert result is False and unchanged and skipped == 1 and next_ok
        assert any("step skipped: the global gradient norm is nan at step 0" in r for r in records)


def test_nonfinite_gradients_raise_when_configured():
    for result, unchanged, _, _, next_ok in run_on_ranks(2, _nonfinite_task, 1, "raise"):
        assert isinstance(result, str) and "global gradient norm is nan at step 0" in result
        assert unchanged and next_ok

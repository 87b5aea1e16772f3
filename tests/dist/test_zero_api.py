"""zero_wrap for an unwrapped model, direct module calls at stage 3, state dicts, bad input."""

from __future__ import annotations

import pytest
import torch
import zero_cases as zc
from torch import nn

import shardwise
from shardwise.precision import resolve_precision
from shardwise.testing import run_on_ranks


def _zero_wrap_task(stage: int, steps: int):
    torch.set_num_threads(1)
    n, r = shardwise.world_size(), shardwise.rank()
    model = zc.make_gpt()
    opt = shardwise.zero_wrap(zc.make_optimizer(model, "adamw"), stage=stage)
    losses = []
    for parts in zc.batches("gpt", steps, n):
        x, y = parts[r]
        loss = model(x, y)
        loss.backward()  # plain local backward; step() averages over ranks
        opt.step()
        opt.zero_grad()
        total = loss.detach() / n
        shardwise.all_reduce(total)
        losses.append(total.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_wrap_matches_single_process(world, stage):
    ref_losses, ref_state, _ = zc.reference("gpt", "adamw", world, 3, 1, None, False)
    for losses, state in run_on_ranks(world, _zero_wrap_task, stage, 3):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def _direct_module_task():
    torch.set_num_threads(1)
    model = zc.make_gpt()
    engine = shardwise.initialize(model, zc.make_optimizer(model, "adamw"),
                                  shardwise.Config(zero_stage=3))
    x, y = zc.batches("gpt", 1, 1)[0][0]
    via_engine = engine(x, y).detach()
    via_module = engine.module(x, y).detach()
    with torch.no_grad():
        logits = engine.module(x)  # no backward: every unit is freed again after forward
    full = [f for f in engine.flats if f.full.untyped_storage().size() > 0]
    sd = engine.state_dict()
    engine.load_state_dict(sd)
    again = engine.module(x, y).detach()
    return via_engine, via_module, tuple(logits.shape), len(full), again


def test_stage3_direct_module_call_and_state_dict_round_trip():
    for via_engine, via_module, shape, gathered, again in run_on_ranks(2, _direct_module_task):
        assert torch.equal(via_engine, via_module) and torch.equal(via_module, again)
        assert shape == (2, zc.GPT_CFG.seq_len, zc.GPT_CFG.vocab_size)
        assert gathered == 0


def _state_dict_task(stage: int):
    model = zc.make_gpt()
    engine = shardwise.initialize(model, zc.make_optimizer(model, "adamw"),
                                  shardwise.Config(zero_stage=stage))
    return engine.state_dict()


@pytest.mark.parametrize("stage", [0, 3])
def test_state_dict_is_full_and_keyed_by_original_names(stage):
    ref = zc.make_gpt().state_dict()
    for sd in run_on_ranks(3, _state_dict_task, stage):
        assert list(sd) == list(ref)  # tied head included under its own name
        for k, v in ref.items():
            assert torch.equal(sd[k], v), k


def test_bad_input_at_initialize():
    shardwise.init()
    model = zc.make_gpt()
    with pytest.raises(ValueError, match="LBFGS cannot be sharded"):
        shardwise.initialize(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match="unknown config key 'zero_stag'; did you mean "
                                         "'zero_stage'"):
        shardwise.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             {"zero_stag": 2})
    with pytest.raises(ValueError, match=r"zero_stage must be one of \[0, 1, 2, 3\], got 5"):
        shardwise.Config(zero_stage=5)

    class Custom(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="Custom is not known to be element-wise"):
        shardwise.initialize(model, Custom(model.parameters(), lr=0.1))
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="different devices"):
        shardwise.initialize(split, torch.optim.SGD(split.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="wrap policy names module classes"):
        shardwise.initialize(zc.make_gpt(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                             shardwise.Config(zero_stage=3, wrap_policy=["Nope"]))
    with pytest.raises(ValueError, match="no submodule of the model is a 'Nope'"):
        shardwise.initialize(zc.make_gpt(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                             shardwise.Config(activation_checkpointing=["Nope"]))
    if not torch.cuda.is_available():  # fp16 asked for where it cannot run
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_precision("fp16", None, torch.device("cuda"))
    with pytest.raises(TypeError, match="pass lr_scheduler as a callable"):
        m = zc.make_gpt()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        shardwise.initialize(m, o, lr_scheduler=torch.optim.lr_scheduler.StepLR(o, 1))

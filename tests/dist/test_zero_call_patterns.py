"""ZeRO trains models that call their parts in unusual ways exactly like one process (fp32).

Units returning a dataclass, a NamedTuple or a plain object; a tied head used functionally from
the root's forward; a wrapper calling its inner model directly; an encoder-decoder whose
generation calls its encoder directly: stages 1-3, and at stage 3 every prefetch depth, each run
three times (a gather that was not waited for would show as run-to-run differences).
"""

from __future__ import annotations

import pattern_models as pm
import pytest
import torch

import shardwise
from shardwise.testing import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3
OUTPUT_KINDS = ["dataclass", "namedtuple", "object"]
CALL_KINDS = ["tied", "wrapper", "encdec"]
POLICIES = {"tied": ["Block"], "wrapper": ["Block"], "encdec": ["Block"]}


def _loss(model, kind: str, b: tuple) -> torch.Tensor:
    return model(*b) if kind != "encdec" else model(b[0], b[1], labels=b[2])


def reference(kind: str, world: int) -> tuple[list[float], dict, list[list[int]]]:
    """One process on the global batch: each rank's micro-batch, losses averaged."""
    model = pm.make(kind)
    opt = pm.optimizer(model)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for part in range(world):
            loss = _loss(model, kind, pm.batch(kind, step, part)) / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    tokens = model.generate(pm.batch(kind, 99, 0)[0], 5).tolist() if kind == "encdec" else []
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, tokens


def _train(kind: str, stage: int, prefetch: int, policy: list[str] | None):
    model = pm.make(kind)
    cfg = shardwise.Config(
        zero_stage=stage, prefetch_units=prefetch, wrap_policy=policy, reduce_bucket_bytes=1024
    )
    engine = shardwise.initialize(model, pm.optimizer(model), cfg)
    world, rank = shardwise.world_size(), shardwise.rank()
    losses = []
    for step in range(STEPS):
        loss = _loss(engine, kind, pm.batch(kind, step, rank))
        engine.backward(loss)
        engine.step()
        total = loss.detach() / world
        shardwise.all_reduce(total)
        losses.append(total.item())
    tokens = []
    if kind == "encdec":
        tokens = engine.module.generate(pm.batch(kind, 99, 0)[0], 5).tolist()
    return losses, engine.state_dict(), tokens


def _task(kinds: list[str], stage: int, with_policy: bool):
    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        policy = POLICIES.get(kind) if with_policy else None
        for prefetch in (0, 1, 2) if stage == 3 else (1,):
            repeats = 3 if stage == 3 else 1
            out[kind, prefetch] = [_train(kind, stage, prefetch, policy) for _ in range(repeats)]
    return out


def _check(results, kinds: list[str], world: int) -> None:
    for kind in kinds:
        ref_losses, ref_state, ref_tokens = reference(kind, world)
        for per_rank in results:
            for (k, prefetch), runs in per_rank.items():
                if k != kind:
                    continue
                first = runs[0]
                for losses, state, tokens in runs:
                    where = f"{kind}, prefetch_units={prefetch}"
                    torch.testing.assert_close(
                        torch.tensor(losses),
                        torch.tensor(ref_losses),
                        rtol=RTOL,
                        atol=ATOL,
                        msg=lambda m, w=where: f"{w}: {m}",
                    )
                    assert state.keys() == ref_state.keys()
                    for name, v in ref_state.items():
                        torch.testing.assert_close(
                            state[name],
                            v,
                            rtol=RTOL,
                            atol=ATOL,
                            msg=lambda m, n=name, w=where: f"{w} {n}: {m}",
                        )
                        assert torch.equal(state[name], first[1][name]), f"{where} {name} unstable"
                    assert tokens == ref_tokens, where


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_units_returning_dataclass_namedtuple_object(world, stage):
    results = run_on_ranks(world, _task, OUTPUT_KINDS, stage, False, timeout_s=900)
    _check(results, OUTPUT_KINDS, world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_used_outside_their_unit(world, stage):
    results = run_on_ranks(world, _task, CALL_KINDS, stage, False, timeout_s=900)
    _check(results, CALL_KINDS, world)


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_used_outside_their_unit_with_wrap_policy(world):
    results = run_on_ranks(world, _task, CALL_KINDS, 3, True, timeout_s=900)
    _check(results, CALL_KINDS, world)

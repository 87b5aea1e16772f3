"""The engine over a PipelineModule (ZeRO 0-3 on each stage's dp axis) on real gloo ranks,
against the whole tied model trained in one process."""

from __future__ import annotations

import pipeline_cases as pc
import pytest
import torch

import shardwise
from shardwise.parallel.pipeline import PipelineModule
from shardwise.testing import run_on_ranks

N_BLOCKS = 6
STEPS = 5
CLIP = 0.5
LR = 0.02
BATCH = 8


def _reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """5 AdamW steps with clipping on the whole batch: losses, norms before clipping, weights."""
    ref = pc.Reference(N_BLOCKS)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = pc.batch(BATCH, seed=step)
        opt.zero_grad()
        loss = ref(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: p.detach().clone() for k, p in ref.named_like_pipeline().items()}


def _train(
    mesh: shardwise.Mesh,
    stage: int,
    schedule: str,
    m: int,
    v: int,
    accum: int,
    regather: bool = True,
    recompute: bool = False,
) -> dict:
    pipe = PipelineModule(pc.layers(N_BLOCKS), pc.lm_loss, mesh, virtual_stages=v, seed=pc.SEED)
    cfg = shardwise.Config(
        zero_stage=stage,
        gradient_clipping=CLIP,
        gradient_accumulation_steps=accum,
        pipeline_schedule=schedule,
        pipeline_microbatches=m,
        pipeline_virtual_stages=v,
        pipeline_zero3_regather=regather,
        activation_checkpointing=["Mix"] if recompute else None,
    )
    engine = shardwise.initialize(
        pipe, torch.optim.AdamW(pipe.parameters(), lr=LR), cfg, group=mesh
    )
    dp, dp_size = mesh.rank("dp"), mesh.dp_size
    losses, norms = [], []
    for step in range(STEPS):
        x, y = pc.batch(BATCH, seed=step)
        mesh.stats.snapshot(reset=True)
        losses.append(engine.train_batch(x.chunk(dp_size)[dp], y.chunk(dp_size)[dp]).item())
        norms.append(engine.grad_norm)
    gathered = mesh.stats.snapshot().get("all_gather", {"bytes": 0})["bytes"]
    x, y = pc.batch(BATCH, seed=STEPS)
    evaluated = engine.eval_batch(x.chunk(dp_size)[dp], y.chunk(dp_size)[dp]).item()
    return {
        "losses": losses,
        "norms": norms,
        "eval": evaluated,
        "state": engine.state_dict(),
        "steps": engine.global_step,
        "gathered_bytes": gathered,  # in the last train_batch
        "flat_bytes": sum(f.padded * f.full.element_size() for f in engine.flats),
    }


def _task(configs: list[tuple], dp: int) -> list[dict]:
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(pp=shardwise.world_size() // dp, dp=dp)
    return [_train(mesh, *c) for c in configs]


def _eval_reference(ref_state: dict[str, torch.Tensor]) -> float:
    ref = pc.Reference(N_BLOCKS)
    with torch.no_grad():
        for k, p in ref.named_like_pipeline().items():
            p.copy_(ref_state[k])
        return ref(*pc.batch(BATCH, seed=STEPS)).item()


def _check(results: list[list[dict]], configs: list, world: int) -> None:
    losses, norms, want = _reference()
    assert min(norms) > CLIP  # clipping is active at every step
    want_eval = _eval_reference(want)
    for i, config in enumerate(configs):
        per_rank = [results[r][i] for r in range(world)]
        tied = []
        for r, out in enumerate(per_rank):
            assert out["steps"] == STEPS
            assert out["losses"] == pytest.approx(losses, rel=1e-5), (config, r)
            assert out["norms"] == pytest.approx(norms, rel=1e-5), (config, r)
            assert out["eval"] == pytest.approx(want_eval, rel=1e-5), (config, r)
            for k, v in out["state"].items():
                torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=f"{config} {k}")
            if "tied.embed.weight" in out["state"]:
                tied.append(out["state"]["tied.embed.weight"])
        assert len(tied) >= 2 and all(torch.equal(t, tied[0]) for t in tied), config
        held = set().union(*(out["state"] for out in per_rank))
        assert held == set(want), config


PP2 = [
    (stage, schedule, 4, 1, 1) for stage in (0, 1, 2) for schedule in ("gpipe", "1f1b", "zb_h1")
] + [
    (1, "interleaved_1f1b", 4, 2, 1),
    (2, "1f1b", 2, 1, 2),  # accumulation 2 x m 2
    (0, "1f1b", 1, 1, 1),
    (1, "1f1b", 4, 1, 1, True, True),  # activation checkpointing of every block
]


def test_pp2_engine_matches_one_process() -> None:
    """pp=2, ZeRO 0-2, every schedule, accumulation and m=1: 5 AdamW steps with clipping give
    the single-process losses, norms, weights and eval loss; tied copies bitwise equal."""
    results = run_on_ranks(2, _task, PP2, 1, timeout_s=900)
    _check(results, PP2, 2)


DP2_PP2 = [(stage, schedule, 2, 1, 1) for stage in (0, 2) for schedule in ("gpipe", "1f1b")] + [
    (1, "1f1b", 2, 1, 1)
]


def test_dp2_pp2_engine_matches_one_process() -> None:
    """Four ranks, each dp replica pipelining half the global batch, ZeRO 0-2 over dp."""
    results = run_on_ranks(4, _task, DP2_PP2, 2, timeout_s=900)
    _check(results, DP2_PP2, 4)


DP2_PP2_ZERO3 = [
    (3, "1f1b", 2, 1, 1, True),
    (3, "1f1b", 2, 1, 1, False),
    (3, "zb_h1", 2, 1, 1, True),
    (3, "gpipe", 1, 1, 2, False),  # accumulation 2: held over both chunks of the step
    (3, "1f1b", 2, 1, 1, False, True),  # and with activation checkpointing
]


def test_dp2_pp2_zero3_engine_matches_one_process() -> None:
    """ZeRO-3 over each stage's dp axis, parameters gathered per micro-batch (regather) or once
    per step: the single-process losses, norms, weights. Once per step gathers each flat
    buffer exactly once (its padded bytes); per micro-batch gathers more."""
    results = run_on_ranks(4, _task, DP2_PP2_ZERO3, 2, timeout_s=900)
    _check(results, DP2_PP2_ZERO3, 4)
    for r in range(4):
        for i, config in enumerate(DP2_PP2_ZERO3):
            out = results[r][i]
            if config[5]:  # regather
                assert out["gathered_bytes"] > out["flat_bytes"], (config, r)
            else:
                assert out["gathered_bytes"] == out["flat_bytes"], (config, r)


HSDP_PP2 = [
    (2, "1f1b", 2, 1, 1),
    (3, "1f1b", 2, 1, 1, False),  # parameters kept for the step
    (3, "gpipe", 2, 1, 1, True),  # and gathered per micro-batch
    (1, "interleaved_1f1b", 2, 2, 1),
]


def _hsdp_task(configs: list[tuple]) -> list[dict]:
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(pp=2, dp_replicate=2, dp_shard=2)
    assert mesh.dp_size == 4
    return [_train(mesh, *c) for c in configs]


def _hsdp_checkpoint_task(root: str) -> tuple[dict, dict]:
    """ZeRO-3 under pp2 x (2 x 2): save after 2 steps and train a third; a pp2 x dp4 engine
    (flat ZeRO-2) loads the save and trains the same third step."""
    torch.set_num_threads(1)

    def engine_of(mesh: shardwise.Mesh, stage: int):
        pipe = PipelineModule(pc.layers(N_BLOCKS), pc.lm_loss, mesh, seed=pc.SEED)
        cfg = shardwise.Config(
            zero_stage=stage, gradient_clipping=CLIP, pipeline_schedule="1f1b",
            pipeline_microbatches=2,
        )  # fmt: skip
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
        return shardwise.initialize(pipe, opt, cfg, group=mesh)

    def step(engine, mesh: shardwise.Mesh, seed: int) -> None:
        x, y = pc.batch(BATCH, seed=seed)
        dp, n = mesh.rank("dp"), mesh.dp_size
        engine.train_batch(x.chunk(n)[dp], y.chunk(n)[dp])

    hsdp = shardwise.Mesh(pp=2, dp_replicate=2, dp_shard=2)
    engine = engine_of(hsdp, 3)
    for seed in range(2):
        step(engine, hsdp, seed)
    engine.save(root)
    step(engine, hsdp, 2)
    flat = shardwise.Mesh(pp=2, dp=4)
    other = engine_of(flat, 2)
    other.load(root)
    step(other, flat, 2)
    return engine.state_dict(), other.state_dict()


def test_hsdp_under_a_pipeline_matches_one_process(tmp_path) -> None:
    """8 ranks: pp2 x (2 replicas x ZeRO over 2): the single-process losses, norms, weights;
    its checkpoint continues on pp2 x flat dp4."""
    results = run_on_ranks(8, _hsdp_task, HSDP_PP2, timeout_s=900)
    _check(results, HSDP_PP2, 8)
    root = str(tmp_path / "ckpt")
    for continued, loaded in run_on_ranks(8, _hsdp_checkpoint_task, root, timeout_s=900):
        assert set(loaded) == set(continued)
        for k in continued:
            torch.testing.assert_close(loaded[k], continued[k], rtol=1e-5, atol=1e-6)


def _refused_task(kwargs: dict, group_is_mesh: bool) -> str:
    mesh = shardwise.Mesh(pp=2, dp=1)
    pipe = PipelineModule(pc.layers(N_BLOCKS), pc.lm_loss, mesh, seed=pc.SEED)
    opt = torch.optim.AdamW(pipe.parameters())
    try:
        shardwise.initialize(
            pipe, opt, shardwise.Config(**kwargs), group=mesh if group_is_mesh else None
        )
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(
    "kwargs, group_is_mesh, message",
    [
        ({"pipeline_virtual_stages": 2}, True, "virtual_stages=1"),
        ({}, False, "pass group=mesh"),
    ],
)
def test_unsupported_pipeline_configs_are_refused(kwargs, group_is_mesh, message) -> None:
    for text in run_on_ranks(2, _refused_task, kwargs, group_is_mesh):
        assert message in text

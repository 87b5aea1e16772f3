"""Hierarchical sharding (HSDP): ZeRO over dp_shard ranks of a node, replicated over dp_replicate
nodes, on real gloo ranks: it trains like one process, holds 1/dp_shard of the sharded model
states per rank, sends exactly the predicted bytes across nodes, and its checkpoints load on
flat dp (and back).

World 4 as 2 nodes of 2 ranks (SHARDWISE_EMULATE_NODES="0,0,1,1"); Ψ parameters, B = 4Ψ bytes,
no padding (every flat buffer's size is a multiple of 4). What this rank sends to the other node
per step (``comm_stats()[op]["inter_node_bytes"]``, ``shardwise.comm.crossing``):

- flat ZeRO over dp=4: reduce_scatter B/2 (the two far chunks), all_gather B/2 per gather
  (stages 1-2 once after the step, stage 3 twice: forward and backward); stage 0 an all_reduce
  of B (B/2 out as the reduce-scatter half, B/2 as the all-gather half);
- HSDP 2 x 2: no reduce_scatter or all_gather leaves the node; the replicate all_reduce of the
  reduced shard (B/2 over 2 ranks: the peer's half of it out, then this rank's half back)
  sends B/2 = (B/2 + B/2) / S, at stages 1-2 exactly 1/S of flat ZeRO's. At stage 3 it is 1/3
  of flat's here: both parameter gathers stay inside the node. Stage 0 shards nothing: the
  whole buffer is all-reduced inside the node, then across it (B, as flat).

Plus the small control all_reduces: the used map (one byte per parameter, +16 at stage 3) and,
flat only, the gradient norm (one fp32 value; HSDP sums it over the shard group only).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import shardwise
from shardwise.checkpoint import CheckpointReader
from shardwise.comm.emulate import NODES_ENV
from shardwise.testing import run_on_ranks

NODES = (0, 0, 1, 1)
STEPS, CLIP, MICRO = 5, 0.05, 3
RTOL, ATOL = 1e-5, 1e-6


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)  # 144 parameters
        self.fc2 = nn.Linear(16, 4)  # 68

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


PSI = 144 + 68
N_PARAMS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


def _batches(parts: int = 4) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 4, generator=g))
             for _ in range(parts)] for _ in range(STEPS)]


def _reference():
    model = _model()
    opt = _opt(model)
    norms = []
    for parts in _batches():
        for x, y in parts:
            (model(x, y) / len(parts)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, norms


def _mesh(hsdp: bool) -> shardwise.Mesh:
    return shardwise.Mesh(dp_replicate=2, dp_shard=2) if hsdp else shardwise.Mesh(dp=4)


def _train_task(stage: int, hsdp: bool):
    torch.set_num_threads(1)
    old = os.environ.get(NODES_ENV)
    os.environ[NODES_ENV] = ",".join(map(str, NODES))
    try:
        mesh = _mesh(hsdp)
        model = _model()
        cfg = shardwise.Config(zero_stage=stage, gradient_clipping=CLIP)
        engine = shardwise.initialize(model, _opt(model), cfg, group=mesh)
        stats, norms, memory = [], [], None
        for step, parts in enumerate(_batches()):
            shardwise.comm_stats(reset=True)
            x, y = parts[mesh.rank("dp")]
            engine.backward(engine(x, y))
            if step == 1:
                memory = engine.memory()
            engine.step()
            norms.append(engine.grad_norm)
            stats.append({op: s["inter_node_bytes"] for op, s in shardwise.comm_stats().items()})
        sizes = [f.padded for f in engine.flats]
        return engine.state_dict(), norms, stats, memory, sizes, mesh.rank("dp_shard")
    finally:
        if old is None:
            del os.environ[NODES_ENV]
        else:
            os.environ[NODES_ENV] = old


def _chunks(numel: int, parts: int, item: int) -> list[int]:
    q, r = divmod(numel, parts)
    return [(q + 1 if i < r else q) * item for i in range(parts)]


def _all_reduce_far(numel: int, item: int, ranks: list[int], me: int) -> int:
    """Bytes ``me`` sends off its node in a reduce_scatter + all_gather exchange over ``ranks``."""
    chunks = _chunks(numel, len(ranks), item)
    far = [j for j, r in enumerate(ranks) if NODES[r] != NODES[me]]
    return sum(chunks[j] for j in far) + len(far) * chunks[ranks.index(me)]


def _control(stage: int, hsdp: bool, rank: int) -> int:
    """The used map (+ the stage-3 gather hash) over every dp rank (HSDP: its shard group, then
    its replicate group), and at stages 1-3 the gradient norm over the shard group."""
    used = N_PARAMS + (16 if stage == 3 else 0)
    if hsdp:
        return _all_reduce_far(used, 1, [rank % 2, rank % 2 + 2], rank)
    world = [0, 1, 2, 3]
    norm = _all_reduce_far(1, 4, world, rank) if stage > 0 else 0
    return _all_reduce_far(used, 1, world, rank) + norm


def _expected(stage: int, hsdp: bool, rank: int, flats: list[int]) -> dict[str, int]:
    if hsdp:  # stage 0 all-reduces the whole buffer across replicas, stages 1-3 the shard
        replicate = [rank % 2, rank % 2 + 2]
        grads = sum(_all_reduce_far(p if stage == 0 else p // 2, 4, replicate, rank)
                    for p in flats)
        return {"all_reduce": grads + _control(stage, hsdp, rank), "reduce_scatter": 0,
                "all_gather": 0}
    world = [0, 1, 2, 3]
    if stage == 0:
        grads = sum(_all_reduce_far(p, 4, world, rank) for p in flats)
        return {"all_reduce": grads + _control(stage, hsdp, rank), "reduce_scatter": 0,
                "all_gather": 0}
    gathers = 2 if stage == 3 else 1
    return {"reduce_scatter": 4 * PSI // 2, "all_gather": gathers * 4 * PSI // 2,
            "all_reduce": _control(stage, hsdp, rank)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hsdp_matches_one_process_bytes_and_memory(stage):
    ref_state, ref_norms = _reference()
    assert all(n > CLIP for n in ref_norms), "clipping must be active"
    runs = {hsdp: run_on_ranks(4, _train_task, stage, hsdp) for hsdp in (True, False)}
    b, s = 4 * PSI, 2
    for hsdp, results in runs.items():
        n = s if hsdp else 4  # ZeRO shards over the dp_shard ranks
        for rank, (state, norms, stats, mem, flats, shard_rank) in enumerate(results):
            assert shard_rank == (rank % 2 if hsdp else rank)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms),
                                       rtol=RTOL, atol=ATOL)
            for k in ref_state:
                torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=k: f"{k}: {m}")
            assert sum(flats) == PSI  # no padding at 2 or 4 ranks
            expected = _expected(stage, hsdp, rank, flats)
            for step_stats in stats:
                assert {op: step_stats.get(op, 0) for op in expected} == expected, (hsdp, rank)
            bulk = sum(expected.values()) - _control(stage, hsdp, rank)
            if hsdp:
                # the reduced part (stages 1-3: the shard, B/S) all-reduced over 2 replicas
                assert bulk == (b if stage == 0 else b // 2)
                flat_bulk = sum(_expected(stage, False, rank, flats).values()) - _control(
                    stage, False, rank)
                # stages 1-2: exactly 1/S of flat ZeRO; stage 3: flat also gathers twice
                # across nodes; stage 0 (nothing sharded): the same bytes
                assert bulk * {0: 1, 1: s, 2: s, 3: 3}[stage] == flat_bulk
            # per-rank model states: the sharded ones / dp_shard (AdamW: exp_avg, exp_avg_sq)
            assert mem["params"] == (b // n if stage == 3 else b)
            assert mem["grads"] == (b if stage <= 1 else b // n)
            assert mem["optimizer"] == (2 * b if stage == 0 else 2 * b // n)


# ---- checkpoints: saved under HSDP, loaded on flat dp, and back ----

def _ckpt_task(save_hsdp: bool, save_stage: int, load_stage: int, root: str):
    """Save after 2 steps, train a third; a new engine of the other layout loads the save and
    trains the same third step."""
    torch.set_num_threads(1)
    data = _batches()

    def engine_of(hsdp: bool, stage: int):
        mesh = _mesh(hsdp)
        model = _model()
        cfg = shardwise.Config(zero_stage=stage, gradient_clipping=CLIP)
        return shardwise.initialize(model, _opt(model), cfg, group=mesh), mesh

    def step(engine, mesh, parts):
        x, y = parts[mesh.rank("dp")]
        engine.backward(engine(x, y))
        engine.step()

    engine, mesh = engine_of(save_hsdp, save_stage)
    for parts in data[:2]:
        step(engine, mesh, parts)
    engine.save(root)
    step(engine, mesh, data[2])
    other, other_mesh = engine_of(not save_hsdp, load_stage)
    other.load(root)
    assert other.global_step == 2
    step(other, other_mesh, data[2])
    return engine.state_dict(), other.state_dict()


@pytest.mark.parametrize(("save_hsdp", "save_stage", "load_stage"),
                         [(True, 2, 3), (False, 3, 1)])
def test_hsdp_checkpoint_loads_on_flat_dp_and_back(tmp_path, save_hsdp, save_stage, load_stage):
    root = str(tmp_path / "ckpt")
    for continued, loaded in run_on_ranks(4, _ckpt_task, save_hsdp, save_stage, load_stage,
                                          root):
        for k in continued:  # the same third step from the saved state (optimizer included)
            torch.testing.assert_close(loaded[k], continued[k], rtol=RTOL, atol=ATOL)
    # the manifest refuses overlapping boxes; under HSDP only the first replica's ranks write
    with CheckpointReader(tmp_path / "ckpt" / "step-00000002") as reader:
        writers = {reader.manifest.files[p.file].rank for n in reader.names()
                   if n.startswith(("model/", "optim/")) for p in reader.manifest.tensors[n].pieces}
    assert writers == ({0, 1} if save_hsdp else {0, 1, 2, 3})


# ---- the mesh ----

def _groups_task():
    mesh = shardwise.Mesh(dp_replicate=2, dp_shard=2)
    r = shardwise.rank()
    out = {name: shardwise.all_gather(torch.tensor([r]), group=mesh.group(name)).tolist()
           for name in ("dp", "dp_shard", "dp_replicate")}
    flat = shardwise.Mesh(dp=4)
    out["flat"] = [flat.group("dp_shard") is flat.group("dp"), flat.group("dp_replicate").size]
    return out, mesh.rank("dp_shard"), mesh.rank("dp_replicate"), repr(mesh)


def test_hsdp_mesh_groups():
    for r, (groups, shard_rank, replicate_rank, text) in enumerate(run_on_ranks(4, _groups_task)):
        assert groups["dp"] == [0, 1, 2, 3]
        assert groups["dp_shard"] == [r - r % 2, r - r % 2 + 1]  # consecutive: one node
        assert groups["dp_replicate"] == [r % 2, r % 2 + 2]
        assert groups["flat"] == [True, 1]
        assert (shard_rank, replicate_rank) == (r % 2, r // 2)
        assert "dp=4 (2 x 2)" in text


def test_hsdp_mesh_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"dp=2 does not match dp_replicate=2 x dp_shard=2"):
        shardwise.Mesh(dp=2, dp_replicate=2, dp_shard=2, world_size=4)
    with pytest.raises(ValueError, match="dp_shard=0 must be >= 1"):
        shardwise.Mesh(dp_shard=0, world_size=4)
    with pytest.raises(ValueError, match="dp_replicate=-1 must be >= 1"):
        shardwise.Mesh(dp_replicate=-1, dp_shard=2, world_size=4)
    with pytest.raises(TypeError, match="dp_shard=2.0 must be an int"):
        shardwise.Mesh(dp_shard=2.0, world_size=4)
    with pytest.raises(ValueError, match="dp_shard=3 does not divide dp=4"):
        shardwise.Mesh(dp_shard=3, world_size=4)
    with pytest.raises(ValueError, match="does not match the world size 4"):
        shardwise.Mesh(dp_replicate=3, dp_shard=2, world_size=4)


def _modifier_task():
    model = _model()
    engine = shardwise.initialize(model, _opt(model), shardwise.Config(zero_stage=3),
                                  group=_mesh(True))
    refused = r"modifier_rank=\.\.\.\) is not supported with hierarchical"
    with pytest.raises(ValueError, match=refused):
        with engine.gathered_parameters(modifier_rank=0):
            pass
    with engine.gathered_parameters():  # reading the full parameters works
        return float(engine.module.fc1.weight.sum())


def test_hsdp_refuses_modifier_rank():
    sums = run_on_ranks(4, _modifier_task)
    assert len(set(sums)) == 1
    assert sums[0] == pytest.approx(float(_model().fc1.weight.detach().sum()), rel=1e-6)


# ---- the replica reduction overlaps the rest of backward ----


def _overlap_task(stage: int):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])  # 272 parameters each
    mesh = _mesh(True)
    cfg = shardwise.Config(zero_stage=stage, reduce_bucket_bytes=272 * 4)  # a bucket per layer
    engine = shardwise.initialize(model, _opt(model), cfg, group=mesh)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(mesh.rank("dp")))
    loss = engine(x).pow(2).mean()
    tracer = mesh.group("dp_replicate").tracer
    tracer.reset()
    engine.backward(loss)
    names = {mesh.group(axis).name: axis for axis in ("dp_shard", "dp_replicate")}
    order = [(e.op, names.get(e.group, e.group), e.start, e.end) for e in tracer.entries()]
    engine.step()
    return order


@pytest.mark.parametrize("stage", [2, 3])
def test_hsdp_replica_reduction_runs_while_backward_goes_on(stage):
    # six buckets: while the replicas' all_reduce of the first bucket is in flight (from its
    # start to the wait that ends it) backward goes on and starts the shard group's
    # reduce_scatter of later buckets; a blocking all_reduce would leave no room for that
    for order in run_on_ranks(4, _overlap_task, stage):
        scatters = [e for e in order if e[:2] == ("reduce_scatter", "dp_shard")]
        crossings = [e for e in order if e[:2] == ("all_reduce", "dp_replicate")]
        assert len(scatters) == len(crossings) == 6, order
        first = crossings[0]
        assert first[3] is not None
        assert any(first[2] < s[2] < first[3] for s in scatters), order

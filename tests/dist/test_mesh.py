"""Process groups, MPI-style split and the pp x dp x tp mesh on real ranks."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.testing import run_on_ranks


def _split_task():
    w, r = shardwise.world_size(), shardwise.rank()
    # even ranks and odd ranks; key reverses the order inside each group
    g = shardwise.split(color=r % 2, key=-r)
    parity = [i for i in range(w) if i % 2 == r % 2]
    assert list(g.ranks) == sorted(parity, reverse=True)
    full = shardwise.all_gather(torch.tensor([r]), group=g)
    assert full.tolist() == list(g.ranks)  # chunks follow group-rank (key) order
    total = shardwise.all_reduce(torch.tensor([float(r)]), group=g)
    assert total.item() == sum(parity)
    mine = shardwise.reduce_scatter(torch.arange(float(2 * g.size)), group=g)
    assert mine.tolist() == [2.0 * g.size * g.rank, 2.0 * g.size * g.rank + g.size]
    none = shardwise.split(color=None if r == 0 else 0)
    assert (none is None) == (r == 0)
    return g.rank


@pytest.mark.parametrize("world", [3, 4])
def test_split(world):
    ranks = run_on_ranks(world, _split_task)
    for r, gr in enumerate(ranks):
        parity = [i for i in range(world) if i % 2 == r % 2]
        assert gr == sorted(parity, reverse=True).index(r)


def _mesh_task(dp, tp, pp):
    mesh = shardwise.Mesh(dp=dp, tp=tp, pp=pp)
    r = shardwise.rank()
    c = mesh.coords
    assert r == (c["pp"] * dp + c["dp"]) * tp + c["tp"]
    assert r == mesh.rank_of(c) and mesh.coords_of(r) == c
    out = {}
    for axes in (("dp",), ("tp",), ("pp",), ("dp", "tp"), ("pp", "dp", "tp")):
        g = mesh.group(*axes)
        members = shardwise.all_gather(torch.tensor([r]), group=g).tolist()
        out["+".join(axes)] = members
    return c, out


def test_mesh_layout_and_groups():
    results = run_on_ranks(4, _mesh_task, 2, 2, 1)
    for r, (c, groups) in enumerate(results):
        assert c == {"pp": 0, "dp_replicate": 0, "dp_shard": r // 2, "cp": 0, "tp": r % 2, "dp": r // 2}
        assert groups["tp"] == [r - r % 2, r - r % 2 + 1]  # tp peers are neighbours
        assert groups["dp"] == [r % 2, r % 2 + 2]
        assert groups["pp"] == [r]
        assert groups["dp+tp"] == [0, 1, 2, 3]
    results = run_on_ranks(4, _mesh_task, 1, 2, 2)
    for r, (c, groups) in enumerate(results):
        assert c == {"pp": r // 2, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": r % 2, "dp": 0}
        assert groups["pp"] == [r % 2, r % 2 + 2]


def test_mesh_rejects_bad_sizes():
    with pytest.raises(ValueError, match="does not match the world size 4"):
        shardwise.Mesh(dp=3, tp=1, pp=1, world_size=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        shardwise.Mesh(dp=0, world_size=4)
    with pytest.raises(ValueError, match="not divisible"):
        shardwise.Mesh(dp=-1, tp=3, world_size=4)


def _generic_axes_task():
    from shardwise.mesh import Axis

    mesh = shardwise.Mesh(dp=2, cp=2, tp=2)  # 8 ranks: dp outermost, then cp, tp innermost
    r = shardwise.rank()
    out = {}
    for axes in ((Axis.CP,), (Axis.CP, Axis.TP), ("dp", "cp"), (Axis.DP_SHARD,), (Axis.PP,)):
        g = mesh.group(*axes)
        out["+".join(axes)] = shardwise.all_gather(torch.tensor([r]), group=g).tolist()
    assert mesh.rank_of(cp=1 - mesh.rank("cp")) == r + (2 if mesh.rank("cp") == 0 else -2)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'; allowed: pp, dp_replicate"):
        mesh.group("ep")
    return mesh.coords, out


def test_a_new_axis_is_generic():
    """cp sits between dp and tp: its peers are tp_size apart, and every combination of axes
    has its group."""
    for r, (c, groups) in enumerate(run_on_ranks(8, _generic_axes_task)):
        assert (c["dp"], c["cp"], c["tp"]) == (r // 4, r // 2 % 2, r % 2)
        assert groups["cp"] == [r - r % 4 + r % 2, r - r % 4 + r % 2 + 2]
        assert groups["cp+tp"] == [r - r % 4 + i for i in range(4)]
        assert groups["dp+cp"] == [r % 2 + 2 * i for i in range(4)]
        assert groups["dp_shard"] == [r % 4, r % 4 + 4]
        assert groups["pp"] == [r]


def _torch_groups() -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _on_use_task():
    from shardwise.comm.current_world import current

    world, r = current(), shardwise.rank()
    before = _torch_groups()
    mesh = shardwise.Mesh(dp=2, tp=2)
    built = _torch_groups() - before  # building the mesh formed nothing
    tp_sum = shardwise.all_reduce(torch.tensor([float(r)]), group=mesh.group("tp")).item()
    after_tp = _torch_groups() - before  # this rank's tp group, on its first collective
    again = shardwise.Mesh(dp=2, tp=2)  # a second mesh over the same ranks shares it
    shardwise.all_reduce(torch.tensor([1.0]), group=again.group("tp"))
    shared = _torch_groups() - before
    # only ranks 0 and 1 build a mesh over themselves and talk in it; 2 and 3 never call
    half = None
    if r < 2:
        half = world.group_on_use([0, 1], "half", world.stats)
        sub = shardwise.Mesh(tp=2, world=half)
        half_sum = shardwise.all_reduce(torch.tensor([10.0 + r]), group=sub.group("tp")).item()
    else:
        half_sum = None
    total = shardwise.all_reduce(torch.tensor([1.0]), group=world.group).item()
    return built, tp_sum, after_tp, shared, half_sum, total


def test_groups_are_formed_on_first_use_by_their_members_alone():
    """Building a mesh forms no torch group; a group's first collective forms it among its
    members alone, meshes over the same ranks share it, and ranks outside a sub-world mesh
    never build it while the others use it. The second run forms the groups again after the
    pool destroyed the first run's (the same ranks, a new torch group)."""
    results = run_on_ranks(4, _on_use_task) + run_on_ranks(4, _on_use_task)
    for i, (built, tp_sum, after_tp, shared, half_sum, total) in enumerate(results):
        r = i % 4
        assert built == 0
        assert tp_sum == 2 * (r - r % 2) + 1
        assert after_tp <= 1 and shared == after_tp  # 0 when an earlier test formed it
        assert half_sum == (21.0 if r < 2 else None)
        assert total == 4.0


_KEPT: dict[str, object] = {}  # per rank process: a mesh one task builds and the next uses


def _keep_mesh_task():
    mesh = _KEPT.setdefault("mesh", shardwise.Mesh(dp=2, tp=2))
    assert isinstance(mesh, shardwise.Mesh)
    return shardwise.all_reduce(torch.tensor([1.0]), group=mesh.group("tp")).item()


def _destroyed_group_task():
    import torch.distributed as dist

    mesh = shardwise.Mesh(dp=2, tp=2)
    tp = mesh.group("tp")
    shardwise.all_reduce(torch.tensor([1.0]), group=tp)
    dist.destroy_process_group(tp.pg)
    with pytest.raises(RuntimeError, match="was destroyed .* build those anew"):
        shardwise.all_reduce(torch.tensor([1.0]), group=tp)
    return True


def test_groups_live_as_long_as_the_pool_keeps_them():
    """A pool that keeps groups lets the next task use a mesh the last one built (a benchmark
    timing engines in turns); a group whose torch group was destroyed under it says so."""
    from shardwise.testing import RankPool

    pool = RankPool(4, keep_groups=True)
    try:
        assert [pool.run(_keep_mesh_task) for _ in range(2)] == [[2.0] * 4] * 2
    finally:
        pool.close()
    assert run_on_ranks(4, _destroyed_group_task) == [True] * 4

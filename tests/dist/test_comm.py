"""Every collective on real gloo ranks (world sizes 1-4), checked against local references."""

from __future__ import annotations

import os

import pytest
import torch

import shardwise
from shardwise import comm
from shardwise.testing import RankError, run_on_ranks

WORLDS = [1, 2, 3, 4]


def _inputs(world: int, shape: tuple[int, ...], dtype=torch.float32) -> list[torch.Tensor]:
    """Every rank's input, reproducible on every rank (so each can compute the reference)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


def _all_reduce_task(shape, op):
    w, r = shardwise.world_size(), shardwise.rank()
    xs = _inputs(w, shape)
    t = xs[r].clone()
    shardwise.all_reduce(t, op=op)
    stacked = torch.stack(xs)
    ref = {
        "sum": stacked.sum(0),
        "avg": stacked.mean(0),
        "max": stacked.amax(0),
        "min": stacked.amin(0),
    }[op]
    torch.testing.assert_close(t, ref, rtol=1e-6, atol=1e-6)
    return shardwise.comm_stats()["all_reduce"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_all_reduce(world, op):
    stats = run_on_ranks(world, _all_reduce_task, (7, 3), op)
    assert all(s["calls"] == 1 and s["bytes"] == 7 * 3 * 4 for s in stats)


def _broadcast_task():
    w, r = shardwise.world_size(), shardwise.rank()
    xs = _inputs(w, (5, 2), torch.float64)
    t = xs[r].clone()
    shardwise.broadcast(t, src=w - 1)
    assert torch.equal(t, xs[w - 1])
    return shardwise.comm_stats()["broadcast"]["bytes"]


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast(world):
    assert run_on_ranks(world, _broadcast_task) == [5 * 2 * 8] * world


def _all_gather_task():
    w, r = shardwise.world_size(), shardwise.rank()
    xs = _inputs(w, (3, 2))
    full = shardwise.all_gather(xs[r])
    assert torch.equal(full, torch.cat(xs))
    parts = shardwise.all_gather_list(xs[r])
    assert all(torch.equal(a, b) for a, b in zip(parts, xs))
    scalar = shardwise.all_gather(torch.tensor(float(r)))
    assert scalar.tolist() == [float(i) for i in range(w)]
    ints = shardwise.all_gather(torch.tensor([r, 10 * r], dtype=torch.int64))
    assert ints.tolist() == [v for i in range(w) for v in (i, 10 * i)]
    h = shardwise.all_gather(xs[r], async_op=True)
    assert torch.equal(h.wait(), torch.cat(xs))
    return shardwise.comm_stats()["all_gather"]


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather(world):
    for s in run_on_ranks(world, _all_gather_task):
        # 4 gathers of (3,2) fp32 (one through all_gather_list) + 1 scalar + 1 int64 pair
        assert s["calls"] == 5
        assert s["bytes"] == 3 * world * 3 * 2 * 4 + world * 4 + world * 2 * 8


def _reduce_scatter_task(shape, op):
    w, r = shardwise.world_size(), shardwise.rank()
    xs = _inputs(w, shape)
    mine = shardwise.reduce_scatter(xs[r].clone(), op=op)
    stacked = torch.stack(xs)
    full = stacked.sum(0) if op == "sum" else stacked.mean(0)
    ref = torch.tensor_split(full, w, dim=0)[r]
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)
    return shardwise.comm_stats()["reduce_scatter"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shape", [(12,), (10,), (7, 3)])
def test_reduce_scatter_uneven(world, shape):
    numel = 1
    for d in shape:
        numel *= d
    for op in ("sum", "avg"):
        for s in run_on_ranks(world, _reduce_scatter_task, shape, op):
            assert s == {
                "calls": 1,
                "bytes": numel * 4,
                "seconds": s["seconds"],
                "inter_node_bytes": 0,
            }


def _send_recv_task():
    w, r = shardwise.world_size(), shardwise.rank()
    msg = torch.full((4,), float(r))
    got = torch.empty(4)
    nxt, prv = (r + 1) % w, (r - 1) % w
    if r % 2 == 0:
        shardwise.send(msg, nxt)
        shardwise.recv(got, prv)
    else:
        h = shardwise.recv(got, prv, async_op=True)
        h.wait()
        shardwise.send(msg, nxt)
    assert got.tolist() == [float(prv)] * 4
    s = shardwise.comm_stats()
    return s["send"]["bytes"], s["recv"]["bytes"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_send_recv(world):
    assert run_on_ranks(world, _send_recv_task) == [(16, 16)] * world


def _coalesced_task():
    w, r = shardwise.world_size(), shardwise.rank()
    a, b = torch.full((3,), float(r)), torch.full((2, 2), float(r + 1))
    c = torch.tensor([r], dtype=torch.int64)
    shardwise.all_reduce_coalesced([a, b, c])
    s = sum(range(w))
    assert a.tolist() == [float(s)] * 3 and b.flatten().tolist() == [float(s + w)] * 4
    assert c.item() == s
    return shardwise.comm_stats()["all_reduce"]


@pytest.mark.parametrize("world", [1, 3])
def test_all_reduce_coalesced(world):
    for st in run_on_ranks(world, _coalesced_task):
        assert st["calls"] == 2 and st["bytes"] == 7 * 4 + 8  # one fp32 buffer, one int64


def _async_avg_task():
    w, r = shardwise.world_size(), shardwise.rank()
    t = torch.full((6,), float(r))
    h = shardwise.all_reduce(t, op="avg", async_op=True)
    out = h.wait()
    assert out is t and t.tolist() == [sum(range(w)) / w] * 6
    rs = shardwise.reduce_scatter(torch.arange(8.0), op="sum", async_op=True).wait()
    assert torch.equal(rs, torch.tensor_split(torch.arange(8.0) * w, w)[r])


@pytest.mark.parametrize("world", [2, 3])
def test_async_handles(world):
    run_on_ranks(world, _async_avg_task)


def _bad_input_task():
    errors = []
    for call in (
        lambda: shardwise.all_reduce(torch.ones(3), op="prod"),
        lambda: shardwise.all_reduce(torch.ones(3, 4).t()),
        lambda: shardwise.all_reduce(torch.ones(3, dtype=torch.bool)),
        lambda: shardwise.all_reduce(torch.ones(3, dtype=torch.int64), op="avg"),
        lambda: shardwise.broadcast(torch.ones(2), src=99),
        lambda: shardwise.all_gather(torch.ones(2), out=torch.empty(5)),
    ):
        try:
            call()
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


def test_bad_input_is_a_clear_error():
    errors = run_on_ranks(2, _bad_input_task)[0]
    assert len(errors) == 6
    assert "unknown reduce op 'prod'" in errors[0] and "allowed" in errors[0]
    assert "not contiguous" in errors[1]
    assert "torch.bool" in errors[2] and "allowed" in errors[2]
    assert "avg" in errors[3]
    assert "src rank 99" in errors[4]
    assert "out must have shape" in errors[5]


def _desync_task(kind):
    comm.set_debug(True)
    r = shardwise.rank()
    try:
        if kind == "op":
            if r == 0:
                shardwise.all_reduce(torch.ones(4))
            else:
                shardwise.broadcast(torch.ones(4), src=0)
        else:
            shardwise.all_reduce(torch.ones(4 if r == 0 else 5))
    except comm.DesyncError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind", ["op", "shape"])
def test_desync_is_caught_in_debug_mode(kind):
    msgs = run_on_ranks(2, _desync_task, kind)
    for m in msgs:
        assert "desync" in m and "rank 0" in m and "rank 1" in m
        if kind == "op":
            assert "all_reduce" in m and "broadcast" in m
        else:
            assert "(4,)" in m and "(5,)" in m


def _hang_task(trace_dir):
    os.environ["SHARDWISE_TRACE_DIR"] = trace_dir
    g = shardwise.new_group([0, 1], timeout_s=2.0)
    shardwise.all_reduce(torch.ones(2), group=g)  # both ranks: completes
    if shardwise.rank() == 0:
        try:
            shardwise.all_reduce(torch.ones(3), group=g)  # rank 1 never joins
        except comm.CollectiveTimeoutError as exc:
            return str(exc)
        return "no timeout"
    return "skipped"


def test_hang_becomes_timeout_with_trace(tmp_path):
    msgs = run_on_ranks(2, _hang_task, str(tmp_path), fresh=True, timeout_s=60)
    assert "timeout of 2 s" in msgs[0] and "all_reduce" in msgs[0]
    trace = (tmp_path / "shardwise-trace-rank0.txt").read_text()
    assert "NOT COMPLETED" in trace and "done in" in trace


def _failing_task():
    if shardwise.rank() == 1:
        raise ValueError("boom on rank one")


def test_harness_reports_failing_rank():
    with pytest.raises(RankError, match=r"(?s)rank 1.*boom on rank one"):
        run_on_ranks(2, _failing_task, timeout_s=30)


def _large_all_gather_task():
    """Messages above P2P_ALL_GATHER_MIN_BYTES take gloo's point-to-point path."""
    from shardwise.comm import ops

    w, r = shardwise.world_size(), shardwise.rank()
    rows = ops.P2P_ALL_GATHER_MIN_BYTES // (4 * 64 * w) + 3
    xs = _inputs(w, (rows, 64))
    full = shardwise.all_gather(xs[r])
    assert torch.equal(full, torch.cat(xs))
    out = torch.empty(w * rows, 64)
    h = shardwise.all_gather(xs[r], out=out, async_op=True)
    h.wait()
    assert torch.equal(out, torch.cat(xs))
    g = shardwise.split(color=0, key=-r)  # reversed group-rank order
    perm = shardwise.all_gather(xs[r], group=g)
    assert torch.equal(perm, torch.cat([xs[i] for i in g.ranks]))
    return shardwise.comm_stats()["all_gather"]["bytes"], rows


@pytest.mark.parametrize("world", [2, 3])
def test_large_all_gather(world):
    for nbytes, rows in run_on_ranks(world, _large_all_gather_task):
        assert nbytes == 3 * world * rows * 64 * 4 + world * 2 * 8  # + split's key exchange


def _inplace_reduce_scatter_task():
    """``out`` aliasing this rank's own chunk of the input (how ZeRO stage 1 reduces)."""
    w, r = shardwise.world_size(), shardwise.rank()
    xs = _inputs(w, (4 * w,))
    buf = xs[r].clone()
    mine = buf[4 * r : 4 * r + 4]
    shardwise.reduce_scatter(buf, op="avg", out=mine)
    torch.testing.assert_close(mine, torch.stack(xs).mean(0)[4 * r : 4 * r + 4])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_into_own_chunk(world):
    run_on_ranks(world, _inplace_reduce_scatter_task)


def _all_to_all_task():
    w, r = shardwise.world_size(), shardwise.rank()
    xs = _inputs(w, (2 * w, 3))
    got = shardwise.all_to_all(xs[r])
    assert torch.equal(got, torch.cat([x.chunk(w)[r] for x in xs]))
    # a group in an order other than torch's gets its chunks in group-rank order
    g = comm.new_group(list(range(w))[::-1])
    got = comm.all_to_all(xs[r], group=g)
    mine = g.rank
    assert torch.equal(got, torch.cat([xs[w - 1 - i].chunk(w)[mine] for i in range(w)]))
    return shardwise.comm_stats()["all_to_all"]


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all(world):
    stats = run_on_ranks(world, _all_to_all_task)
    assert all(s["calls"] == 2 and s["bytes"] == 2 * (2 * world * 3 * 4) for s in stats)

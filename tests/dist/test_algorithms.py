"""all_reduce algorithms on real gloo ranks: equal to native, the same bits on every rank, and the
wire bytes their formulas give."""

from __future__ import annotations

import hashlib

import pytest
import torch

import shardwise
from shardwise import comm
from shardwise.comm import ops
from shardwise.comm.allreduce_rounds import GroupLinks, LinkCost
from shardwise.testing import RankError, run_on_ranks

FLAT = ["ring", "halving_doubling", "tree"]
# 1 element .. 1 MiB + 3 elements of fp32; most not divisible by any world size
SIZES = [1, 2, 3, 5, 17, 1000, 4099, (1 << 18) + 3]


def _nodes(world: int) -> tuple[int, ...]:
    """Two nodes where the world splits evenly, else one rank per node."""
    return tuple(r * 2 // world for r in range(world)) if world % 2 == 0 else tuple(range(world))


def _inputs(world: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        return [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
    return [
        torch.randint(-(1 << 40), 1 << 40, (n,), generator=g, dtype=dtype) for _ in range(world)
    ]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()


def _equality_task(sizes: list[int]) -> list[str]:
    w, r = shardwise.world_size(), shardwise.rank()
    nodes = _nodes(w)
    digests = []
    for n in sizes:
        for dtype in (torch.int64, torch.float32):
            xs = _inputs(w, n, dtype)
            native = xs[r].clone()
            comm.all_reduce(native, op="sum", group=comm.world())
            for alg in [*FLAT, "hierarchical"]:
                t = xs[r].clone()
                comm.all_reduce(t, "sum", group=comm.world(), algorithm=alg, nodes=nodes)
                if dtype == torch.int64:
                    assert torch.equal(t, native), (alg, n)
                else:
                    torch.testing.assert_close(t, native, msg=f"{alg} n={n}")
                digests.append(_digest(t))
    return digests


@pytest.mark.parametrize("world", [2, 3, 4, pytest.param(8, marks=pytest.mark.long)])
def test_equal_to_native_and_identical_on_every_rank(world):
    sizes = SIZES if world <= 4 else SIZES[:7]  # 8 ranks on 2 cores: keep it to 16 KiB
    digests = run_on_ranks(world, _equality_task, sizes, timeout_s=600)
    assert all(d == digests[0] for d in digests)


def _ops_task() -> None:
    w, r = shardwise.world_size(), shardwise.rank()
    comm.set_debug(True)  # the desync check covers the call, not its point-to-point messages
    xs = _inputs(w, 37, torch.float32)
    stacked = torch.stack(xs)
    refs = {"max": stacked.amax(0), "min": stacked.amin(0), "avg": stacked.mean(0)}
    for alg in [*FLAT, "hierarchical"]:
        for op, ref in refs.items():
            t = xs[r].clone().view(37, 1)  # any shape: reduced as a flat view
            h = comm.all_reduce(
                t, op, group=comm.world(), async_op=True, algorithm=alg, nodes=_nodes(w)
            )
            torch.testing.assert_close(h.wait().view(-1), ref, msg=f"{alg} {op}")


@pytest.mark.parametrize("world", [3, 4])
def test_max_min_avg_and_handles(world):
    run_on_ranks(world, _ops_task)


N = 840  # divisible by 1..8: the formulas are exact


def _bytes_task(alg: str) -> tuple[int, int, int, int]:
    w, r = shardwise.world_size(), shardwise.rank()
    t = torch.full((N,), float(r))
    comm.all_reduce(t, "sum", group=comm.world(), algorithm=alg, nodes=_nodes(w))
    assert torch.equal(t, torch.full((N,), float(sum(range(w)))))
    s = shardwise.comm_stats()
    return (
        s["all_reduce"]["calls"],
        s["all_reduce"]["bytes"],
        s.get("send", {}).get("bytes", 0),
        s.get("recv", {}).get("bytes", 0),
    )


@pytest.mark.parametrize("world", [2, 3, 4, pytest.param(8, marks=pytest.mark.long)])
@pytest.mark.parametrize("alg", [*FLAT, "hierarchical"])
def test_wire_bytes_match_the_formulas(world, alg):
    stats = run_on_ranks(world, _bytes_task, alg, timeout_s=600)
    nbytes = N * 4
    assert all(s[:2] == (1, nbytes) for s in stats)
    sent = [s[2] for s in stats]
    assert sum(sent) == sum(s[3] for s in stats)
    if alg == "ring":
        assert sent == [2 * (world - 1) * nbytes // world] * world
    elif alg == "halving_doubling":
        big = 1 << (world.bit_length() - 1)
        extra = world - big
        # folded ranks send their vector once; the P others 2(P-1)/P of it
        assert sum(sent) == 2 * extra * nbytes + 2 * (big - 1) * nbytes
        if extra == 0:
            assert sent == [2 * (world - 1) * nbytes // world] * world
    elif alg == "tree":
        assert sum(sent) == 2 * (world - 1) * nbytes and sent[0] > 0
    else:
        n_nodes = len(set(_nodes(world)))
        per_node = world // n_nodes
        intra = 2 * (per_node - 1) * nbytes // per_node
        inter = 2 * (n_nodes - 1) * nbytes // (n_nodes * per_node)
        assert sent == [intra + inter] * world


def _auto_task() -> tuple[str, int, int]:
    w = shardwise.world_size()
    slow = GroupLinks(_nodes(w), LinkCost(1e-5, 1e-10), LinkCost(1e-3, 1e-7))
    t = torch.ones(1 << 16)
    picked = comm.allreduce_rounds.choose(t.numel() * 4, 4, slow)
    sent = []
    for alg in ("auto", picked):
        comm.comm_stats(reset=True)
        comm.all_reduce(t.fill_(1.0), "sum", group=comm.world(), algorithm=alg, links=slow)
        assert torch.equal(t, torch.full_like(t, float(w)))
        sent.append(comm.comm_stats()["send"]["bytes"])
    return picked, sent[0], sent[1]


def test_auto_runs_the_algorithm_the_model_picks():
    for picked, auto_bytes, picked_bytes in run_on_ranks(4, _auto_task):
        assert picked == "hierarchical"  # inter-node links 1000x slower: cross them least
        assert auto_bytes == picked_bytes


def _bad_input_task(kind: str) -> None:
    t = torch.ones(4)
    if kind == "unknown":
        comm.all_reduce(t, algorithm="butterfly")
    elif kind == "auto":  # the library's entry point: the public one measures the links itself
        ops.all_reduce(t, group=comm.world(), algorithm="auto")
    elif kind == "uneven_nodes":
        comm.all_reduce(t, group=comm.world(), algorithm="hierarchical", nodes=(0, 0, 1))
    elif kind == "no_nodes":
        ops.all_reduce(t, group=comm.world(), algorithm="hierarchical")


@pytest.mark.parametrize(
    "kind,match",
    [
        ("unknown", "allowed"),
        ("auto", "links="),
        ("uneven_nodes", "same number of ranks on every node"),
        ("no_nodes", "nodes="),
    ],
)
def test_bad_input_names_the_fix(kind, match):
    with pytest.raises(RankError, match=match):
        run_on_ranks(3, _bad_input_task, kind)


def _auto_without_links_task() -> tuple[int, int, list[tuple[int, ...]]]:
    """The public all_reduce with algorithm="auto" and no links: the current world's links are
    measured on the first call (one barrier per pair of ranks, ``measure_links``) and reused."""
    w, r = shardwise.world_size(), shardwise.rank()
    world = comm.current()
    comm.comm_stats(reset=True)
    for dtype in (torch.int64, torch.float32):
        xs = _inputs(w, 1000, dtype)
        native = xs[r].clone()
        comm.all_reduce(native)
        for alg in ("auto", "auto", "hierarchical"):
            t = xs[r].clone()
            comm.all_reduce(t, algorithm=alg)
            if dtype == torch.int64:
                assert torch.equal(t, native), alg
            else:
                torch.testing.assert_close(t, native, msg=alg)
        if dtype == torch.int64:
            barriers_after_first = comm.comm_stats()["barrier"]["calls"]
    barriers = comm.comm_stats()["barrier"]["calls"]
    return barriers_after_first, barriers, list(world.measured_links)


@pytest.mark.parametrize("world", [2, 3])
def test_auto_at_the_facade_measures_the_worlds_links_once(world):
    results = run_on_ranks(world, _auto_without_links_task)
    pairs = world * (world - 1) // 2
    for first, total, measured in results:
        assert first == total == pairs  # discovery ran once: no barrier after the first call
        assert measured == [tuple(range(world))]

"""Topology discovery on real gloo ranks: islands from the launcher or emulated nodes, an
alpha-beta fit of every link with R² >= 0.95, the emulated slow link visible in the fits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import shardwise
from shardwise import comm
from shardwise.cli.launch import free_port
from shardwise.comm import emulate
from shardwise.testing import run_on_ranks
from shardwise.topology import discover

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


def _discover_task(nodes: str, link: str):
    os.environ[emulate.NODES_ENV] = nodes
    if link:
        os.environ[emulate.LINK_ENV] = link
    try:
        topo = discover(comm.world(), sizes=SIZES, reps=15)
        choice = None
        if link:
            links = topo.links()
            choice = comm.allreduce_rounds.choose(4 << 20, 4, links)
            t = torch.ones(1 << 20)
            comm.all_reduce(t, "sum", group=comm.world(), algorithm="auto", links=links)
            assert torch.equal(t, torch.full_like(t, float(shardwise.world_size())))
        return topo.to_dict(), choice
    finally:
        os.environ.pop(emulate.NODES_ENV, None)
        os.environ.pop(emulate.LINK_ENV, None)


def test_two_ranks_fit_well():
    results = run_on_ranks(2, _discover_task, "0,0", "", timeout_s=600)
    topo = shardwise.topology.Topology.from_dict(results[0][0])
    assert all(r[0] == results[0][0] for r in results)  # every rank holds the same answer
    assert topo.islands()["node"] == [(0, 1)]
    assert [r.local_rank for r in topo.ranks] == [0, 1]
    assert topo.min_r2() >= 0.95, topo.fits
    # between CPU processes of one host the bytes go through their cores: half-duplex
    assert topo.links().intra.duplex is False


def _fit_collectives_task():
    from shardwise.costmodel import calibrate as cal

    fits = cal.fit_collectives(comm.world(), sizes=(256 << 10, 1 << 20, 4 << 20), iters=2)
    assert set(fits) == set(cal.COLLECTIVES)
    # a size below equal_time_bytes is timed that many times more per turn
    world, sizes = comm.world(), (256 << 10, 1 << 20)
    samples = cal.sample_collectives(world, sizes, 2, ("all_gather",), 1 << 20)
    assert {k: len(v) for k, v in samples.items()} == {
        ("all_gather", 256 << 10): 8, ("all_gather", 1 << 20): 2}  # fmt: skip
    loss = cal.measure_sync_loss(comm.world(), segments_s=(0.002, 0.005), reps=2, rounds=1)
    with pytest.raises(ValueError, match="reps >= 1"):
        cal.measure_sync_loss(comm.world(), reps=0)
    return {op: (c.alpha_s, c.beta_s_per_byte) for op, c in fits.items()}, loss


def test_collectives_are_fitted_where_they_run():
    # every rank times the same collectives and gets the same fit (the slowest rank's times)
    results = run_on_ranks(2, _fit_collectives_task, timeout_s=600)
    assert results[0] == results[1]
    fits, loss = results[0]
    for alpha, beta in fits.values():
        assert alpha >= 0 and beta > 0
    # the share of compute lost meeting at blocking all_reduces: a measurement, clamped at 0
    # and finite; no upper bound (on a busy machine the two ranks' segments can drift apart
    # by more than a segment's length)
    assert loss >= 0 and math.isfinite(loss)


@pytest.mark.long  # about 20 s of timed links: CI runs it in its long step
def test_emulated_nodes_group_ranks_and_slow_the_inter_node_links():
    link = "inter=alpha:2ms,bw:0.2GB/s"
    results = run_on_ranks(4, _discover_task, "0,0,1,1", link, timeout_s=600)
    topo = shardwise.topology.Topology.from_dict(results[0][0])
    assert topo.islands()["node"] == [(0, 1), (2, 3)]
    assert [r.node for r in topo.ranks] == ["node0", "node0", "node1", "node1"]
    assert [r.local_rank for r in topo.ranks] == [0, 1, 0, 1]
    assert topo.min_r2() >= 0.95
    # the emulated delay is a sleep: a lower bound on every cross-node message
    for i, j in [(0, 2), (0, 3), (1, 2), (1, 3)]:
        fit = topo.fits[i][j]
        assert fit.alpha_s + SIZES[0] * fit.beta_s_per_byte >= 2e-3
        assert fit.beta_s_per_byte >= 0.9 / 0.2e9
    assert {c for _, c in results} == {"hierarchical"}


def _launcher(node_rank: int, port: int, out: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shardwise.cli.main", "topology", "--nnodes", "2",
            "--node-rank", str(node_rank), "--nproc-per-node", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--sizes", "4096,1048576,4194304",
            "--reps", "3", "--json", out]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.long
def test_two_launchers_form_two_nodes(tmp_path):
    port = free_port()
    outs = [str(tmp_path / f"topo{i}.json") for i in range(2)]
    procs = [_launcher(i, port, outs[i]) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    written = [o for o in outs if os.path.exists(o)]
    assert len(written) == 1  # rank 0 writes it, from whichever launcher holds rank 0
    topo = shardwise.topology.Topology.read_json(written[0])
    assert topo.islands()["node"] == [(0, 1), (2, 3)]
    assert [r.local_rank for r in topo.ranks] == [0, 1, 0, 1]
    assert "node islands:" in "".join(logs)
    assert json.loads(open(written[0]).read())["sizes"] == [4096, 1048576, 4194304]


@pytest.mark.parametrize("world", [3])
def test_topology_command_writes_json_and_png(tmp_path, world):
    argv = [sys.executable, "-m", "shardwise.cli.main", "topology", "--nproc-per-node",
            str(world), "--sizes", "4096,1048576,4194304", "--reps", "3",
            "--json", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bandwidth (GB/s)" in out.stdout and "R² of the fit" in out.stdout
    assert (tmp_path / "t.png").stat().st_size > 0
    assert shardwise.topology.Topology.read_json(tmp_path / "t.json").world_size == world

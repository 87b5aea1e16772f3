"""Launcher environments, backend choice and rendezvous timeouts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shardwise import dist as sw_dist
from shardwise.cli.launch import free_port


def test_torchrun_env():
    env = sw_dist.read_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "1234",
        }
    )
    assert (
        env.rank,
        env.world_size,
        env.local_rank,
        env.master_addr,
        env.master_port,
        env.source,
    ) == (3, 4, 1, "h0", 1234, "torchrun")


def test_openmpi_and_pmi_env():
    env = sw_dist.read_launch_env(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.source) == (2, 8, 2, "mpi")
    env = sw_dist.read_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (env.rank, env.world_size) == (1, 2)


def test_slurm_env_first_host():
    env = sw_dist.read_launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODELIST": "gpu[07-09,12]",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 8, 1, "gpu07")
    assert sw_dist._first_slurm_host("nodeA,nodeB") == "nodeA"


def test_no_launcher_is_a_world_of_one():
    env = sw_dist.read_launch_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


def test_bad_env_and_backend():
    with pytest.raises(sw_dist.DistInitError, match="outside world size"):
        sw_dist.read_launch_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="unknown backend 'tcp'; allowed: auto, gloo, nccl, mpi"):
        sw_dist.resolve_backend("tcp")
    with pytest.raises(ValueError, match=r"not available|needs CUDA"):
        sw_dist.resolve_backend("mpi" if not sw_dist.dist.is_mpi_available() else "nccl")
    assert sw_dist.resolve_backend("auto") in ("gloo", "nccl")


def test_rank_that_never_joins_times_out_clearly():
    code = textwrap.dedent("""
        import shardwise
        try:
            shardwise.init(backend="gloo", timeout=2)
        except shardwise.DistInitError as exc:
            print("ERR", exc)
    """)
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "ERR" in out.stdout, out.stderr
    assert "timeout of 2 s" in out.stdout and "2 ranks" in out.stdout

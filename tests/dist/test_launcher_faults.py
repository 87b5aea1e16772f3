"""``shardwise run`` under faults, as real processes: the launcher killed (-9) on one node and
on two, signals and their exit codes, a missing node, a held rendezvous port, script options."""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil
import pytest
from launcher_procs import SPIN, Cli, assert_all_gone, free_port, wait_ranks

from shardwise.checkpoint import CheckpointError, verify


def test_kill_9_of_the_launcher_takes_its_ranks_along():
    cli = Cli("run", "--nproc-per-node", "2", str(SPIN))
    try:
        cli.wait_for("rank 1 started")
        ranks = wait_ranks(cli, 2)
        os.kill(cli.proc.pid, signal.SIGKILL)
        assert_all_gone(ranks)
    finally:
        cli.cleanup()


def test_kill_9_of_one_node_ends_both_nodes():
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint]
    nodes = [Cli(*common, "--node-rank", str(k), str(SPIN)) for k in (0, 1)]
    try:
        for cli in nodes:
            cli.wait_for("started")
        ranks = [r for cli in nodes for r in wait_ranks(cli, 1)]
        os.kill(nodes[0].proc.pid, signal.SIGKILL)  # node 0 also hosts the rendezvous
        assert_all_gone(ranks, timeout=60)
        assert nodes[1].finish(60) != 0
    finally:
        for cli in nodes:
            cli.cleanup()


def test_ctrl_c_on_run_exits_130():
    cli = Cli("run", "--nproc-per-node", "2", str(SPIN))
    try:
        cli.wait_for("rank 1 started")
        ranks = wait_ranks(cli, 2)
        cli.proc.send_signal(signal.SIGINT)
        assert cli.finish(60) == 130, cli.output[-3000:]
        assert_all_gone(ranks)
        assert "Traceback" not in cli.output, cli.output[-3000:]
        assert "rank 0: interrupted (SIGINT)" in cli.output
    finally:
        cli.cleanup()


def test_sigint_to_one_rank_exits_130():
    cli = Cli("run", "--nproc-per-node", "2", str(SPIN))
    try:
        cli.wait_for("rank 1 started")
        ranks = wait_ranks(cli, 2)
        rank1 = next(r for r in ranks if r.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGINT)
        assert cli.finish(60) == 130, cli.output[-3000:]
        assert_all_gone(ranks)
        assert "rank 1: interrupted (SIGINT)" in cli.output
    finally:
        cli.cleanup()


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period():
    script = SPIN.parent / "deaf.py"
    cli = Cli("run", "--nproc-per-node", "1", "--grace-period-s", "2", str(script))
    try:
        cli.wait_for("deaf rank started")
        ranks = wait_ranks(cli, 1)
        t0 = time.monotonic()
        cli.proc.send_signal(signal.SIGHUP)
        assert cli.finish(60) == 129, cli.output[-3000:]
        assert time.monotonic() - t0 < 30
        assert_all_gone(ranks)
        assert "SIGHUP: stopping the ranks (they have 2 s, then SIGKILL)" in cli.output
        assert "did not exit within the grace period" in cli.output
    finally:
        cli.cleanup()


def test_script_options_reach_the_script():
    cli = Cli("run", "--nproc-per-node", "1", str(SPIN), "--max", "3", "--d", "x")
    try:
        assert cli.finish(120) == 0, cli.output[-3000:]
        assert "rank 0 started: max=3 d='x'" in cli.output and "rank 0 done" in cli.output
    finally:
        cli.cleanup()
    cli = Cli("run", "--nproc-per-node", "1", "--", str(SPIN), "--max", "2")
    try:
        assert cli.finish(120) == 0, cli.output[-3000:]
        assert "max=2" in cli.output
    finally:
        cli.cleanup()


def test_a_missing_node_is_reported_while_waiting_then_times_out():
    endpoint = f"127.0.0.1:{free_port()}"
    cli = Cli(
        "run",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-timeout",
        "3",
        str(SPIN),
    )
    try:
        assert cli.finish(60) == 1, cli.output[-3000:]
        assert f"waiting for 1 of 2 nodes at {endpoint}" in cli.output
        last = cli.output.strip().splitlines()[-1]
        assert last.startswith("shardwise run: error: only 1 of 2 nodes joined"), last
        assert "--rdzv-timeout" in last and "Traceback" not in cli.output
    finally:
        cli.cleanup()


def test_a_rendezvous_port_held_by_another_program_is_refused():
    # rank pools that earlier tests left running are this process's children too
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        cli = Cli(
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            str(SPIN),
        )
        try:
            assert cli.finish(60) == 2, cli.output[-3000:]
            assert cli.output.strip() == (
                f"shardwise run: error: the rendezvous port 127.0.0.1:{port} is held by another "
                "program (Address already in use): choose another --rdzv-endpoint port"
            )
        finally:
            cli.cleanup()
        # a non-host node dialing a port where no rendezvous answers gives up with a message
        cli = Cli(
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-timeout",
            "3",
            str(SPIN),
        )
        try:
            assert cli.finish(60) == 1, cli.output[-3000:]
            assert "no shardwise rendezvous answered" in cli.output
        finally:
            cli.cleanup()
    assert not {c.pid for c in psutil.Process().children(recursive=True)} - before


@pytest.mark.parametrize("shutdown", [False, True], ids=["at-exit", "after-shutdown"])
def test_an_unwaited_async_save_is_finished_at_the_end(tmp_path, shutdown):
    root = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(root)] + (["--shutdown"] if shutdown else [])
    cli = Cli("run", "--nproc-per-node", "2", str(SPIN.parent / "async_exit.py"), *args)
    try:
        assert cli.finish(120) == 0, cli.output[-3000:]
    finally:
        cli.cleanup()
    when = "at shardwise.shutdown()" if shutdown else "at exit"
    for rank in (0, 1):
        assert f"rank {rank}: the checkpoint of step 1 was still being saved {when}" in cli.output
        assert f"rank {rank}: finished: step 1 committed" in cli.output
    assert "terminate called" not in cli.output and "Traceback" not in cli.output
    # without shutdown() the group is left at exit too, while the interpreter is whole
    assert cli.output.count("process group still formed at exit: False") == 2, cli.output
    assert verify(root / "step-00000001").step == 1


def test_an_unwaited_save_that_outlasts_the_exit_wait_is_abandoned_uncommitted(tmp_path):
    # every rank's save stalls 60 s; the end of the process waits 1 s for it, says it abandoned
    # it, and exits cleanly: the step is never committed, nothing half-written is taken as valid
    root = tmp_path / "ckpt"
    stall = {"SHARDWISE_CKPT_STALL_S": "60", "SHARDWISE_EXIT_SAVE_WAIT_S": "1"}
    script = str(SPIN.parent / "async_exit.py")
    cli = Cli(
        "run", "--nproc-per-node", "2", script, "--checkpoint-dir", str(root), extra_env=stall
    )
    try:
        assert cli.finish(50) == 0, cli.output[-3000:]
    finally:
        cli.cleanup()
    for rank in (0, 1):
        assert f"rank {rank}: the checkpoint of step 1 was still being saved at exit" in cli.output
        assert f"rank {rank}: abandoned the save of step 1 after 1 s" in cli.output
    assert "committed" not in cli.output and "Traceback" not in cli.output
    assert not (root / "step-00000001").exists()
    with pytest.raises(CheckpointError):
        verify(root / "step-00000001")


@pytest.mark.parametrize("mode", ["exit", "raise", "shutdown"])
def test_no_gloo_thread_outlives_the_end_of_a_script(mode):
    # six engines, then sys.exit(0), an uncaught ValueError, or shutdown(): every torch gloo
    # thread is gone before the interpreter's teardown, where one finishing a collective would
    # abort the process ("terminate called without an active exception", #22)
    script = str(SPIN.parent / "engines_exit.py")
    cli = Cli("run", "--nproc-per-node", "2", script, mode, "--report-threads")
    try:
        assert cli.finish(180) == (1 if mode == "raise" else 0), cli.output[-3000:]
    finally:
        cli.cleanup()
    assert cli.output.count("gloo threads while training: 3") == 2, cli.output[-3000:]
    assert cli.output.count("gloo threads left at exit: 0") == 2, cli.output[-3000:]
    assert "terminate called" not in cli.output

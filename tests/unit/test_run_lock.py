"""The run directory lock: one job at a time, the holder named, a dead holder's lock taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from shardwise.train import lock as lock_mod
from shardwise.train.lock import LOCK_NAME, RunDirLock, RunDirLocked


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_holder_is_refused_with_host_and_pid(tmp_path):
    with RunDirLock(tmp_path):
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            RunDirLock(tmp_path).acquire()
    # released: the next job gets it, and no stale record is left
    assert (tmp_path / LOCK_NAME).read_text() == ""
    RunDirLock(tmp_path).acquire().release()


def test_another_process_is_refused_while_the_holder_lives(tmp_path):
    code = (
        "import sys; from shardwise.train.lock import RunDirLock, RunDirLocked\n"
        "try:\n    RunDirLock(sys.argv[1]).acquire()\n"
        "except RunDirLocked as e:\n    print(e); sys.exit(3)\n"
    )
    with RunDirLock(tmp_path):
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
        )
    assert out.returncode == 3, out.stderr
    assert f"in use by pid {os.getpid()}" in out.stdout


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = _dead_pid()
    record = {"host": socket.gethostname(), "pid": dead, "since": 0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="shardwise.train"):
        with RunDirLock(tmp_path):
            assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"stale lock of pid {dead} on host" in caplog.text


def test_without_kernel_locks_the_record_decides(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(lock_mod, "fcntl", None)  # a filesystem or platform without flock
    live = {"host": socket.gethostname(), "pid": os.getppid(), "since": 0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(live))
    with pytest.raises(RunDirLocked, match=f"pid {os.getppid()}"):
        RunDirLock(tmp_path).acquire()
    dead = {"host": socket.gethostname(), "pid": _dead_pid(), "since": 0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(dead))
    with caplog.at_level(logging.WARNING, logger="shardwise.train"):
        RunDirLock(tmp_path).acquire().release()
    assert "stale lock" in caplog.text

"""Helpers of the launcher fault tests: start ``shardwise`` as a real subprocess, find its ranks,
wait for output, and make sure nothing is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
SPIN = ROOT / "tests" / "dist" / "scripts" / "spin.py"
TINY_TRAIN = ["--model", "tiny", "--max-bytes", "200000", "--eval-every", "0"]


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


class Cli:
    """A running ``shardwise`` command whose merged output is collected as it comes."""

    def __init__(self, *args: str, extra_env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardwise.cli.main", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env(**(extra_env or {})),
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None and text not in self.output:
                self._reader.join(5)
                if text in self.output:
                    return
                raise AssertionError(
                    f"exited {self.proc.returncode} before {text!r}:\n{self.output[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout} s:\n{self.output[-4000:]}")
            time.sleep(0.1)

    def ranks(self) -> list[psutil.Process]:
        """The rank processes (direct children running ``shardwise.cli.run_rank``)."""
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [k for k in kids if "shardwise.cli.run_rank" in " ".join(_cmdline(k))]

    def finish(self, timeout: float = 240) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def cleanup(self) -> None:
        """Kill whatever is left: the launcher's session and any rank."""
        for p in self.ranks():
            _kill(p)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _kill(p: psutil.Process) -> None:
    try:
        p.kill()
    except psutil.NoSuchProcess:
        pass


def wait_ranks(cli: Cli, n: int, timeout: float = 120) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while len(ranks := cli.ranks()) < n:
        if time.monotonic() > deadline or cli.proc.poll() is not None:
            raise AssertionError(f"{len(ranks)} of {n} ranks running:\n{cli.output[-4000:]}")
        time.sleep(0.1)
    return ranks


def assert_all_gone(procs: list[psutil.Process], timeout: float = 30) -> None:
    """No orphan: every process in ``procs`` ends within ``timeout``."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        _kill(p)
    assert not alive, f"left running: {[p.pid for p in alive]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

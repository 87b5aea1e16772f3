"""Start a benchmark's ranks as fresh processes under another interpreter (e.g. a separate
virtual environment with DeepSpeed), with the rendezvous variables torch's launcher would set."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(
    python: str, script: Path, spec_path: Path, log_dir: Path, world: int, **extra_env: str
) -> list[tuple[subprocess.Popen, IO[str]]]:
    """``world`` processes of ``python script spec_path``, one thread each, logging to
    ``log_dir/rank{r}.log``; each with its open log, which the caller closes."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)]),
            **extra_env,
        }
        log = open(log_dir / f"rank{rank}.log", "w")
        cmd = [python, str(script), str(spec_path)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
    return procs

"""The launcher's agent: starts this node's ranks, watches them, stops them on a signal, and
restarts all of them after a failure.

- Ranks run ``python -m shardwise.cli.run_rank TARGET`` in their own session, so a terminal's
  Ctrl-C reaches the launcher only, which forwards it once; they die with the launcher (see
  ``run_rank``).
- SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to the ranks (SIGHUP as SIGTERM), which
  get ``grace_s`` seconds to finish (a training run ends its step and saves); then SIGKILL.
  A second signal kills at once.
- A rank that exits 129/130/143 was asked to stop (a signal to that rank alone): the others get
  the grace period to stop too (a training run stops all ranks after the same step).
- A rank that fails (exits non-zero otherwise) stops the others (SIGTERM, then SIGKILL after
  ``FAILURE_GRACE_S``), unless within ``CAUSE_WINDOW_S`` a peer exits asked to stop (the
  failure was its consequence); with restarts left, every rank starts again with
  ``SHARDWISE_RESTART_COUNT`` one higher. Across nodes, the rendezvous store
  tells every node (see ``run_rendezvous``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from shardwise.cli.run_rank import LAUNCHER_PID_ENV
from shardwise.cli.run_rendezvous import Rendezvous, free_port
from shardwise.environment import RESTART_COUNT_ENV

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOPPED_CODES = frozenset(128 + int(s) for s in STOP_SIGNALS)
"""Rank exit codes that mean "asked to stop", not "failed": never restarted."""

FAILURE_GRACE_S = 5.0
"""Seconds the surviving ranks get to exit after another rank failed."""

POLL_S = 0.1
CAUSE_WINDOW_S = 1.0
"""How long a rank's failure waits for a peer's stop code (129/130/143) that would explain it."""


@dataclass(frozen=True)
class LaunchPlan:
    """What to start and how; the launcher's options, checked."""

    target: list[str]
    """``script.py ARGS`` or ``-m module ARGS``."""
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` where node 0 hosts the rendezvous (None: one node, a free local port)."""
    max_restarts: int = 0
    rdzv_timeout_s: float = 600.0
    """How long the rendezvous waits for every node."""


@dataclass(frozen=True)
class LaunchResult:
    """How the ranks ended."""

    code: int
    """The launcher's exit code: 0, the failed rank's code, or 128 + the stop signal."""
    stop_signal: signal.Signals | None = None
    """The signal that stopped the launcher, if one did."""
    killed: bool = False
    """Whether ranks had to be killed (SIGKILL) after the grace period."""
    failed_rank: int | None = None
    """Global rank whose failure ended the run (None: none, or on another node)."""
    restarts: int = 0


class _SignalLatch:
    """Records stop signals instead of dying; installed while ranks run."""

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum))

    def __enter__(self) -> _SignalLatch:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell exit code (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class RankProcs:
    """This node's rank processes of one attempt."""

    def __init__(self, plan: LaunchPlan, attempt: int, master: tuple[str, int]) -> None:
        self.first_rank = plan.node_rank * plan.nproc_per_node
        self.procs: list[subprocess.Popen[bytes]] = []
        world = plan.nproc_per_node * plan.nnodes
        for local in range(plan.nproc_per_node):
            env = dict(
                os.environ,
                RANK=str(self.first_rank + local),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(plan.nproc_per_node),
                GROUP_RANK=str(plan.node_rank),
                MASTER_ADDR=master[0],
                MASTER_PORT=str(master[1]),
                **{
                    RESTART_COUNT_ENV: str(attempt),
                    "TORCHELASTIC_RESTART_COUNT": str(attempt),  # what torchrun scripts read
                    LAUNCHER_PID_ENV: str(os.getpid()),
                },
            )
            cmd = [sys.executable, "-m", "shardwise.cli.run_rank", *plan.target]
            self.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def send(self, sig: signal.Signals) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def stop(self, sig: signal.Signals, grace_s: float, latch: _SignalLatch | None) -> bool:
        """Send ``sig``, wait up to ``grace_s`` for every rank, then SIGKILL the rest (at once
        on another signal to the launcher). Returns whether all exited in time."""
        seen = len(latch.received) if latch else 0
        self.send(sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(c is None for c in self.codes()):
            if latch is not None and len(latch.received) > seen:
                break
            time.sleep(POLL_S)
        in_time = all(c is not None for c in self.codes())
        self.kill()
        return in_time


@dataclass(frozen=True)
class _Outcome:
    code: int
    stop_signal: signal.Signals | None = None
    killed: bool = False
    failed_rank: int | None = None


@dataclass
class _Watching:
    """What the watch has seen so far in one attempt."""

    stopping: tuple[int, float] | None = None  # (stop code, deadline for the others)
    failed: tuple[int, int, float] | None = None  # (exit code, local rank, when it counts)


def _check_ranks(
    procs: RankProcs,
    seen: _Watching,
    grace_s: Callable[[], float],
    rdzv: Rendezvous | None,
    attempt: int,
) -> _Outcome | None:
    """Look at the ranks' exit codes once; the outcome when the attempt is over.

    A rank that exited asked to stop (129/130/143) starts the grace period for the others (a
    rank that failed beside it is a consequence, not the cause). A failure counts once
    ``CAUSE_WINDOW_S`` passed without such a stop, or every rank has exited: a rank leaving
    its process group on its way out can fail a peer before its own exit code shows."""
    codes = procs.codes()
    if all(c == 0 for c in codes):
        return _Outcome(0)
    now = time.monotonic()
    if seen.stopping is None:
        for code in codes:
            if code is not None and exit_code(code) in STOPPED_CODES:
                seen.stopping, seen.failed = (exit_code(code), now + grace_s()), None
                break
    if seen.stopping is not None:
        if all(c is not None for c in codes) or now > seen.stopping[1]:
            procs.stop(signal.SIGTERM, FAILURE_GRACE_S, None)
            return _Outcome(seen.stopping[0])
        return None
    if seen.failed is None:
        for local, code in enumerate(codes):
            if code is not None and code != 0:
                seen.failed = (exit_code(code), local, now + CAUSE_WINDOW_S)
                break
    if seen.failed is None or (now < seen.failed[2] and None in codes):
        return None
    code, local, _ = seen.failed
    if rdzv is not None:
        rdzv.mark_failed(attempt)
    procs.stop(signal.SIGTERM, FAILURE_GRACE_S, None)
    return _Outcome(code, failed_rank=procs.first_rank + local)


def _watch(
    procs: RankProcs,
    latch: _SignalLatch,
    grace_s: Callable[[], float],
    say: Callable[[str], None],
    rdzv: Rendezvous | None,
    attempt: int,
) -> _Outcome:
    last_remote_check = time.monotonic()
    seen = _Watching()
    while True:
        if latch.received:
            sig = latch.received[0]
            grace = grace_s()
            say(f"{sig.name}: stopping the ranks (they have {grace:g} s, then SIGKILL)")
            forward = signal.SIGTERM if sig == signal.SIGHUP else sig
            in_time = procs.stop(forward, grace, latch)
            return _Outcome(128 + int(sig), sig, killed=not in_time)
        outcome = _check_ranks(procs, seen, grace_s, rdzv, attempt)
        if outcome is not None:
            return outcome
        if rdzv is not None and time.monotonic() - last_remote_check > 1.0:
            last_remote_check = time.monotonic()
            if seen.stopping is None and rdzv.failed(attempt):
                say("ranks on another node failed: stopping this node's ranks")
                procs.stop(signal.SIGTERM, FAILURE_GRACE_S, None)
                return _Outcome(1)
        time.sleep(POLL_S)


def run_agent(
    plan: LaunchPlan, grace_s: Callable[[], float], say: Callable[[str], None]
) -> LaunchResult:
    """Start the ranks and supervise them until they end; see the module docstring.

    Raises:
        RendezvousError: the nodes did not meet within ``plan.rdzv_timeout_s``.
        ValueError: the rendezvous port is held by another program.
    """
    rdzv = None
    if plan.rdzv_endpoint is not None:
        rdzv = Rendezvous(plan.rdzv_endpoint, plan.nnodes, plan.node_rank, plan.rdzv_timeout_s, say)
    attempt = 0
    while True:
        master = rdzv.join(attempt) if rdzv else ("127.0.0.1", free_port())
        with _SignalLatch() as latch:
            procs = RankProcs(plan, attempt, master)
            try:
                out = _watch(procs, latch, grace_s, say, rdzv, attempt)
            finally:
                procs.kill()  # nothing outlives the agent, whatever happened above
        if rdzv is not None:
            rdzv.finish(attempt, plan.rdzv_timeout_s)
        retry = (
            out.code != 0
            and out.stop_signal is None
            and out.code not in STOPPED_CODES
            and attempt < plan.max_restarts
        )
        if not retry:
            return LaunchResult(out.code, out.stop_signal, out.killed, out.failed_rank, attempt)
        who = "a rank on another node" if out.failed_rank is None else f"rank {out.failed_rank}"
        attempt += 1
        say(
            f"{who} failed (exit code {out.code}): restarting all ranks "
            f"(restart {attempt} of {plan.max_restarts})"
        )

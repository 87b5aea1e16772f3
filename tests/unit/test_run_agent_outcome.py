"""How the launcher's agent names the outcome of an attempt from its ranks' exit codes: a rank
asked to stop (130) explains a peer that failed just before it."""

from __future__ import annotations

import time

from shardwise.cli import run_agent
from shardwise.cli.run_agent import _check_ranks, _Watching


class Ranks:
    """Exit codes as a rank watcher sees them, poll by poll (None: still running)."""

    first_rank = 0

    def __init__(self, *codes: int | None) -> None:
        self.now = list(codes)
        self.stopped = False

    def codes(self) -> list[int | None]:
        return list(self.now)

    def stop(self, *args: object) -> bool:
        self.stopped = True
        return True


def test_a_failure_waits_for_a_peers_stop_code_that_explains_it():
    # rank 1 was interrupted; leaving its group failed rank 0, which exited first
    ranks, seen = Ranks(1, None), _Watching()
    assert _check_ranks(ranks, seen, lambda: 10.0, None, 0) is None
    ranks.now = [1, 130]
    outcome = _check_ranks(ranks, seen, lambda: 10.0, None, 0)
    assert outcome is not None and outcome.code == 130 and ranks.stopped


def test_a_failure_alone_counts_after_the_window(monkeypatch):
    monkeypatch.setattr(run_agent, "CAUSE_WINDOW_S", 0.05)
    ranks, seen = Ranks(None, 3), _Watching()
    assert _check_ranks(ranks, seen, lambda: 10.0, None, 0) is None
    time.sleep(0.1)
    outcome = _check_ranks(ranks, seen, lambda: 10.0, None, 0)
    assert outcome is not None and outcome.code == 3 and outcome.failed_rank == 1


def test_a_failure_counts_at_once_when_every_rank_has_exited():
    outcome = _check_ranks(Ranks(0, 2), _Watching(), lambda: 10.0, None, 0)
    assert outcome is not None and outcome.code == 2 and outcome.failed_rank == 1

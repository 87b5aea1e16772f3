"""Graceful stop on SIGINT / SIGTERM / SIGHUP: the loop finishes its step, then every rank
stops together.

The launcher forwards a stop signal it receives to its ranks (SIGHUP as SIGTERM); ``kill -INT``
may reach one rank only. The handler only raises a flag, so no collective is
ever cut in half; the loop shares the flag with the other ranks at the end of each step (see
``loop.py``) so that all of them stop after the same step.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger("shardwise.train")

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
"""Shell convention: 128 + the signal number."""


class StopRequest:
    """Installs handlers for SIGINT, SIGTERM and SIGHUP that record the signal instead of raising.

    Use as a context manager; the previous handlers come back on exit.
    """

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum)
            log.warning("%s received: stopping after this step", self.signal.name)

    @property
    def requested(self) -> bool:
        """Whether this rank received a stop signal."""
        return self.signal is not None

    def stop_with(self, signum: int) -> None:
        """Record a stop that another rank received (so this rank exits with the same code)."""
        if self.signal is None:
            self.signal = signal.Signals(signum)

    @property
    def exit_code(self) -> int:
        """130 after SIGINT, 143 after SIGTERM, 129 after SIGHUP, 0 when no stop was requested."""
        return EXIT_CODES.get(self.signal, 1) if self.signal is not None else 0

    def __enter__(self) -> StopRequest:
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

"""Saving in the background: snapshot to host memory now, write and commit while training runs.

The background thread coordinates over its own process group, formed when the writer is
constructed, so its collectives never interleave with the training step's on the main group.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

from shardwise import dist as sw_dist
from shardwise import environment
from shardwise.checkpoint.entries import ShardEntry, prepare_entries
from shardwise.checkpoint.rank_state import encode_rank_state
from shardwise.checkpoint.writer import check_trainer_state, save_snapshot
from shardwise.comm import Group

log = logging.getLogger("shardwise.checkpoint")

DEFAULT_TIMEOUT_S = 1800.0

EXIT_WAIT_S = 600.0
"""How long the end of the process (or ``shardwise.shutdown``) waits for a pending save, unless
``SHARDWISE_EXIT_SAVE_WAIT_S`` says otherwise."""
EXIT_WAIT_ENV = "SHARDWISE_EXIT_SAVE_WAIT_S"

_LIVE: weakref.WeakSet[AsyncCheckpointWriter] = weakref.WeakSet()


class AsyncCheckpointWriter:
    """Background checkpoint saves into one root; construct and use it on every rank.

    Args:
        root: checkpoint root on a filesystem every rank sees.
        keep_last: after each commit, keep only the newest ``keep_last`` checkpoints.
        timeout_s: how long a rank's background thread waits for the others (the slowest
            rank's write must fit in it). Default 1800 s.
        verify_writes: read each written file back and check its sha256 before the commit.
        group: the ranks that save together; file names use their group ranks.

    Construction is collective: it forms the writer's own process group over the ranks of
    ``group`` (``World.new_group``), so each of them must construct it at the same point.
    """

    def __init__(
        self,
        root: Path | str,
        keep_last: int | None = None,
        timeout_s: float | None = None,
        verify_writes: bool = True,
        *,
        group: Group,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
        timeout = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        if timeout <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.verify_writes = verify_writes
        base = group
        self.group = base.world.new_group(list(base.ranks), timeout_s=timeout, dedicated=True)
        self._rank = self.group.ranks[self.group.rank]
        self.last_committed: Path | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None  # of the save in flight
        _LIVE.add(self)

    @property
    def pending(self) -> bool:
        """True while a save is being written or committed."""
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        step: int,
        entries: list[ShardEntry],
        trainer_state: dict[str, Any],
        rank_state: Any,
    ) -> None:
        """Snapshot this rank's state and save it as step ``step`` in the background.

        Blocks only to finish the previous save (re-raising its error) and to copy the entries
        to host memory, ``trainer_state`` through JSON and ``rank_state`` into its file bytes: the
        caller may change all of them once this returns. Arguments as in ``save_checkpoint``.

        Communicates (from the background thread, on this writer's group): the collectives of
        ``save_checkpoint``.
        """
        self.wait()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        snapshot: list[ShardEntry] = []
        state, blob, error = trainer_state, b"", None
        try:
            snapshot = prepare_entries(entries, copy=True)
            state = check_trainer_state(trainer_state)
            blob = encode_rank_state(rank_state)
        except Exception as exc:  # raised on every rank by the protocol, via wait()
            error = exc
        self._step = step
        self._thread = threading.Thread(
            target=self._run,
            args=(step, snapshot, state, blob, error),
            daemon=True,
            name=f"shardwise-ckpt-step{step}",
        )
        self._thread.start()

    def _run(
        self,
        step: int,
        entries: list[ShardEntry],
        trainer_state: dict[str, Any],
        blob: bytes,
        error: Exception | None,
    ) -> None:
        try:
            self.last_committed = save_snapshot(
                self.root,
                step,
                entries,
                trainer_state,
                blob,
                keep_last=self.keep_last,
                group=self.group,
                verify_writes=self.verify_writes,
                local_error=error,
            )
        except BaseException as exc:  # handed to the caller by wait()
            log.error("rank %d: background save of step %d failed: %s", self._rank, step, exc)
            self._error = exc

    def wait(self, timeout_s: float | None = None) -> Path | None:
        """Block until the pending save is committed; return its path (None if none yet).

        Raises:
            The pending save's error, once. TimeoutError when ``timeout_s`` passes first
            (the save keeps running; call ``wait`` again).
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint save still running after {timeout_s} s")
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self.last_committed

    def close(self) -> None:
        """Wait for the pending save (raising its error)."""
        self.wait()

    def __enter__(self) -> AsyncCheckpointWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._thread is not None:  # already failing: wait, keep the first error
            self._thread.join()

    def finish_unwaited(self, timeout_s: float, when: str) -> None:
        """Finish a save nobody waited for (or abandon it after ``timeout_s``) and log which:
        the end of the process must neither cut it nor hang on it."""
        if self._thread is None:
            return
        step, rank = self._step, self._rank
        log.warning(
            "rank %d: the checkpoint of step %s was still being saved %s (call "
            "wait_for_checkpoint() before the end): finishing it",
            rank,
            step,
            when,
        )
        try:
            path = self.wait(timeout_s)
        except TimeoutError:
            log.error("rank %d: abandoned the save of step %s after %g s", rank, step, timeout_s)
        except Exception as exc:  # its error is logged; the process is ending anyway
            log.error("rank %d: the save of step %s failed, not committed: %s", rank, step, exc)
        else:
            log.warning("rank %d: finished: step %s committed at %s", rank, step, path)


def exit_wait_s() -> float:
    """How long the end of the process waits for an unwaited save: ``SHARDWISE_EXIT_SAVE_WAIT_S``
    seconds if set to a number > 0 (otherwise a logged error and the default), else 600."""
    try:
        seconds = environment.read(EXIT_WAIT_ENV)
    except environment.EnvError as exc:  # the process is ending: say so, and wait the default
        log.error("%s; waiting %g s", exc, EXIT_WAIT_S)
        return EXIT_WAIT_S
    return EXIT_WAIT_S if seconds is None else float(seconds)


def finish_pending_saves(when: str = "at exit", timeout_s: float | None = None) -> None:
    """Finish (or abandon, after ``timeout_s``, default ``exit_wait_s()``) every background save
    of this process that nobody waited for; runs at interpreter exit and before
    ``shardwise.shutdown`` leaves."""
    if not _LIVE:  # nothing to wait for: the variable is not even read
        return
    wait = exit_wait_s() if timeout_s is None else timeout_s
    for writer in list(_LIVE):
        writer.finish_unwaited(wait, when)


atexit.register(finish_pending_saves)
sw_dist.before_leaving(finish_pending_saves)

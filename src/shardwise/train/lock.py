"""One job per run directory: an exclusive lock on ``RUN_DIR/.lock`` for the life of a job.

The lock is an ``fcntl.flock`` on the file, which the kernel drops when its holder dies however
it dies, so a lock is never left behind on a local filesystem. The file also records the
holder's host and pid (JSON): a second job is refused naming them. Where the filesystem does not
support ``flock`` (or on a platform without ``fcntl``), the record alone decides: a holder on
this host whose pid is gone is stale, and its lock is taken over with a warning.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

try:
    import fcntl
except ImportError:  # not POSIX: the record alone
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("shardwise.train")

LOCK_NAME = ".lock"


class RunDirLocked(ValueError):
    """Another live job holds the run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_holder(f: IO[str]) -> dict[str, Any] | None:
    f.seek(0)
    text = f.read()
    try:
        holder = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "another process"
    return f"pid {holder.get('pid')} on host {holder.get('host')}"


class RunDirLock:
    """Hold ``root/.lock`` exclusively; use as a context manager or ``acquire``/``release``.

    Raises ``RunDirLocked`` (a ``ValueError``) on acquire when a live job holds it.
    """

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> RunDirLock:
        f = open(self.path, "a+", encoding="utf-8")
        try:
            kernel = self._flock(f)
            holder = _read_holder(f)
            if holder is not None and not kernel and self._alive(holder):
                raise RunDirLocked(self._refusal(holder))
            if holder is not None:
                log.warning(
                    "%s: taking over the stale lock of %s, which is no longer running",
                    self.path.parent,
                    _describe(holder),
                )
            f.seek(0)
            f.truncate()
            record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
            f.write(json.dumps(record) + "\n")
            f.flush()
        except BaseException:
            f.close()
            raise
        self._file = f
        return self

    def _flock(self, f: IO[str]) -> bool:
        """Take the kernel lock; True when the kernel enforces it, False when unsupported."""
        if fcntl is None:
            return False
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirLocked(self._refusal(_read_holder(f))) from None
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise
        return True

    @staticmethod
    def _alive(holder: dict[str, Any]) -> bool:
        if holder.get("host") != socket.gethostname():
            return True  # cannot tell from here: assume the other host's job is alive
        pid = holder.get("pid")
        return isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid)

    def _refusal(self, holder: dict[str, Any] | None) -> str:
        return (
            f"run directory {self.path.parent} is in use by {_describe(holder)}: wait for that "
            f"job to end or stop it (if it is gone, delete {self.path})"
        )

    def release(self) -> None:
        """Clear the record and drop the lock (a clean end leaves no stale record)."""
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.flush()
        finally:
            self._file.close()  # closing drops the flock
            self._file = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

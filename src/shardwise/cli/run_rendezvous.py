"""Multi-node rendezvous of the launchers: node 0 hosts a key-value store at ``--rdzv-endpoint``,
every node's launcher joins it once per attempt.

Keys of attempt ``r``: ``r/node<k>`` (guards against two nodes with the same ``--node-rank``),
``r/joined`` (count), ``r/master`` (``HOST:PORT`` where rank 0 forms the ranks' process group),
``r/failed`` (set by the first node whose ranks fail: every node then stops its ranks) and
``r/done`` (count of nodes whose ranks ended; node 0 keeps the store up until all have).
"""

from __future__ import annotations

import datetime
import errno
import socket
import threading
import time
from collections.abc import Callable

from torch.distributed import TCPStore

PROGRESS_EVERY_S = 10.0
"""Seconds between "waiting for ..." lines."""

CONNECT_TRY_S = 2.0
"""One attempt of a non-host node to reach the host's store."""

HANDSHAKE_S = 8.0
"""Beyond ``CONNECT_TRY_S``, how long a connected attempt may wait for the store to answer."""


class RendezvousError(RuntimeError):
    """The nodes did not meet: timeout, a held port, or a duplicate node rank."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ``ValueError`` naming the flag otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {endpoint!r}"
        )
    return host.strip("[]"), int(port)


def check_port_free(host: str, port: int) -> None:
    """Raise ``ValueError`` when another program holds ``port`` (so our store cannot listen)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise ValueError(
                    f"the rendezvous port {host}:{port} is held by another program "
                    f"({exc.strerror}): choose another --rdzv-endpoint port"
                ) from exc
            raise


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Rendezvous:
    """One node's view of the launchers' rendezvous.

    Args:
        endpoint: ``HOST:PORT``; node 0 listens there, the other nodes connect.
        nnodes, node_rank: the number of nodes and this one's index.
        timeout_s: how long joining may wait for the other nodes.
        say: where progress lines go (one line each).
    """

    def __init__(
        self,
        endpoint: str,
        nnodes: int,
        node_rank: int,
        timeout_s: float,
        say: Callable[[str], None],
    ) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self.endpoint = f"{self.host}:{self.port}"
        self.nnodes, self.node_rank, self.timeout_s, self.say = nnodes, node_rank, timeout_s, say
        self.store = self._host() if node_rank == 0 else self._connect()

    def _host(self) -> TCPStore:
        check_port_free(self.host, self.port)
        try:
            return TCPStore(
                self.host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
        except RuntimeError as exc:
            raise ValueError(
                f"cannot listen for the rendezvous at {self.endpoint}: {exc}; "
                "choose another --rdzv-endpoint port"
            ) from exc

    def _connect(self) -> TCPStore:
        deadline = time.monotonic() + self.timeout_s
        next_line = time.monotonic()
        while True:
            if time.monotonic() >= next_line:
                self.say(f"waiting for node 0's rendezvous at {self.endpoint}")
                next_line = time.monotonic() + PROGRESS_EVERY_S
            try:
                return self._try_connect()
            except (RuntimeError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"no shardwise rendezvous answered at {self.endpoint} within "
                        f"{self.timeout_s:g} s (--rdzv-timeout): start node 0 there ({exc})"
                    ) from exc
                time.sleep(0.5)

    def _try_connect(self) -> TCPStore:
        """One connection attempt, in a thread: a program that accepts the connection but is
        not a store would otherwise hold us forever."""
        box: dict[str, object] = {}

        def dial() -> None:
            try:
                box["store"] = TCPStore(
                    self.host,
                    self.port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=CONNECT_TRY_S),
                )
            except (RuntimeError, OSError) as exc:
                box["error"] = exc

        thread = threading.Thread(target=dial, daemon=True, name="shardwise-rdzv-dial")
        thread.start()
        thread.join(CONNECT_TRY_S + HANDSHAKE_S)
        if thread.is_alive():
            raise RendezvousError(
                f"something at {self.endpoint} accepted the connection but does not answer as "
                "a shardwise rendezvous: the port is held by another program; choose another "
                "--rdzv-endpoint port"
            )
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["store"]  # type: ignore[return-value]

    def join(self, attempt: int) -> tuple[str, int]:
        """Wait until all nodes joined ``attempt``; returns rank 0's ``(addr, port)``."""
        if self.store.add(f"{attempt}/node{self.node_rank}", 1) > 1:
            raise RendezvousError(
                f"two nodes joined {self.endpoint} with --node-rank {self.node_rank}: "
                "give each node its own"
            )
        if self.node_rank == 0:
            self.store.set(f"{attempt}/master", f"{self.host}:{free_port()}")
        key = f"{attempt}/joined"
        joined = self.store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        next_line = time.monotonic()
        while joined < self.nnodes:
            if time.monotonic() >= next_line:
                missing = self.nnodes - joined
                self.say(f"waiting for {missing} of {self.nnodes} nodes at {self.endpoint}")
                next_line = time.monotonic() + PROGRESS_EVERY_S
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"only {joined} of {self.nnodes} nodes joined at {self.endpoint} within "
                    f"{self.timeout_s:g} s (--rdzv-timeout): start the others with the same "
                    "--rdzv-endpoint and --nnodes"
                )
            time.sleep(0.2)
            joined = self.store.add(key, 0)
        host, _, port = self.store.get(f"{attempt}/master").decode().rpartition(":")
        return host, int(port)

    def mark_failed(self, attempt: int) -> None:
        """Tell every node that this node's ranks of ``attempt`` failed."""
        try:
            self.store.set(f"{attempt}/failed", str(self.node_rank))
        except (RuntimeError, OSError):
            pass  # the host is gone: the other nodes notice that by themselves

    def failed(self, attempt: int) -> bool:
        """Whether some node's ranks of ``attempt`` failed (or the host is unreachable)."""
        try:
            return bool(self.store.check([f"{attempt}/failed"]))
        except (RuntimeError, OSError):
            return True

    def finish(self, attempt: int, wait_s: float) -> None:
        """Report this node's ranks as ended; node 0 waits (up to ``wait_s``) for the others,
        since its store goes away with it."""
        try:
            self.store.add(f"{attempt}/done", 1)
            deadline = time.monotonic() + wait_s
            while self.node_rank == 0 and time.monotonic() < deadline:
                if self.store.add(f"{attempt}/done", 0) >= self.nnodes or self.failed(attempt):
                    return
                time.sleep(0.2)
        except (RuntimeError, OSError):
            pass

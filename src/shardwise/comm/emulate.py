"""A slow inter-node link on one machine: delays point-to-point traffic between ranks of
different nodes, so hierarchical and flat algorithms differ measurably without a second host.

Turned on by the environment (read once per process, every rank alike):

- ``SHARDWISE_EMULATE_LINK="inter=alpha:200us,bw:0.1GB/s"``: every message from this rank to a
  rank of another node waits ``alpha + bytes / bw`` before it is posted (the sender's link is
  busy for that long: messages from one rank serialize, as on one NIC). ``alpha`` takes ``s``,
  ``ms`` or ``us``; ``bw`` takes ``B/s``, ``KB/s``, ``MB/s`` or ``GB/s`` (powers of 10).
- ``SHARDWISE_EMULATE_NODES="0,0,1,1"``: the node of every global rank, in rank order. Without
  it, nodes come from torchrun's variables (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``), which lay ranks
  out node-major with the same number of ranks on every node.

Only the communication layer's ``send`` is delayed (the backend's own collectives are not), so
under emulation compare the algorithms of ``shardwise.comm.algorithms``, not ``"native"``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from shardwise import environment

LINK_ENV = "SHARDWISE_EMULATE_LINK"
NODES_ENV = "SHARDWISE_EMULATE_NODES"

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_BW_UNITS = {"B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9}


@dataclass(frozen=True)
class LinkDelay:
    """The emulated inter-node link: latency ``alpha_s`` and bandwidth ``bytes_per_s``."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s


def _number(text: str, units: dict[str, float], what: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)\s*", text)
    if not m or m.group(2) not in units:
        raise ValueError(
            f"{LINK_ENV}: bad {what} {text!r}; write a number and one of {', '.join(units)}"
        )
    return float(m.group(1)) * units[m.group(2)]


def parse_link(spec: str) -> LinkDelay:
    """Parse ``"inter=alpha:200us,bw:0.1GB/s"`` (both keys required, bw > 0)."""
    if not spec.startswith("inter="):
        raise ValueError(f"{LINK_ENV}={spec!r}: expected 'inter=alpha:<time>,bw:<rate>'")
    fields: dict[str, str] = {}
    for part in spec[len("inter=") :].split(","):
        key, sep, value = part.partition(":")
        if not sep or key.strip() not in ("alpha", "bw"):
            raise ValueError(f"{LINK_ENV}={spec!r}: bad field {part!r}; allowed: alpha:, bw:")
        fields[key.strip()] = value
    if set(fields) != {"alpha", "bw"}:
        raise ValueError(f"{LINK_ENV}={spec!r}: needs both alpha: and bw:")
    alpha = _number(fields["alpha"], _TIME_UNITS, "alpha")
    bw = _number(fields["bw"], _BW_UNITS, "bw")
    if bw <= 0:
        raise ValueError(f"{LINK_ENV}={spec!r}: bw must be > 0")
    return LinkDelay(alpha, bw)


def parse_nodes(spec: str, world_size: int) -> tuple[int, ...]:
    """Parse ``"0,0,1,1"``: one non-negative node id per global rank."""
    nodes: tuple[int, ...] = environment.read(NODES_ENV, {NODES_ENV: spec})
    if len(nodes) != world_size:
        raise ValueError(
            f"{NODES_ENV}={spec!r}: needs one node id >= 0 per rank ({world_size} ranks)"
        )
    return nodes


def env_nodes(world_size: int, env: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """The node of every global rank from the environment, or None when it does not say.

    ``SHARDWISE_EMULATE_NODES`` first; else torchrun's node-major layout when ``GROUP_RANK`` and
    ``LOCAL_WORLD_SIZE`` are set and ``LOCAL_WORLD_SIZE`` divides the world.
    """
    env = dict(os.environ) if env is None else env
    if env.get(NODES_ENV):
        return parse_nodes(env[NODES_ENV], world_size)
    if "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        per_node = int(env["LOCAL_WORLD_SIZE"])
        if per_node > 0 and world_size % per_node == 0:
            return tuple(r // per_node for r in range(world_size))
    return None


@dataclass(frozen=True)
class Emulator:
    """Which ranks sit on which node, and the link between nodes."""

    link: LinkDelay
    nodes: tuple[int, ...]

    def delay_s(self, src: int, dst: int, nbytes: int) -> float:
        if self.nodes[src] == self.nodes[dst]:
            return 0.0
        return self.link.seconds(nbytes)


_cache: dict[tuple[str, str, int], Emulator | None] = {}


def active(world_size: int) -> Emulator | None:
    """The emulator the environment asks for, or None (parsed once per setting)."""
    spec = os.environ.get(LINK_ENV, "")
    key = (spec, os.environ.get(NODES_ENV, ""), world_size)
    if key not in _cache:
        emu = None
        if spec:
            nodes = env_nodes(world_size)
            if nodes is None:
                raise ValueError(
                    f"{LINK_ENV} is set but the nodes are unknown: set {NODES_ENV} "
                    "(e.g. '0,0,1,1') or launch with --nnodes"
                )
            emu = Emulator(parse_link(spec), nodes)
        _cache[key] = emu
    return _cache[key]


def delay_send(src: int, dst: int, nbytes: int, world_size: int) -> None:
    """Hold a message from global rank ``src`` to ``dst`` as the emulated link would."""
    emu = active(world_size)
    if emu is not None:
        wait = emu.delay_s(src, dst, nbytes)
        if wait > 0:
            time.sleep(wait)


environment.LINK_GRAMMAR[:] = [parse_link]

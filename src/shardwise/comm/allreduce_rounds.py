"""All-reduce algorithms as data: which rank sends which element range to whom, round by round.

One schedule drives both the executor (``shardwise.comm.algorithms``) and the cost prediction
(``predict_seconds``), so the model prices exactly the messages that run. Ranks are group ranks;
a ``Transfer`` moves elements ``[lo, hi)`` of the flat tensor from ``src`` to ``dst``, which
either reduces them into its own copy (``reduce``) or overwrites its copy. In one round a rank
sends at most one message and receives at most one; rounds are not barriers (a rank starts the
next round as soon as its own messages of this one are done).

Costs (alpha latency, beta seconds per byte, n bytes, p ranks; PARALLELISM.md 1.4):

- ring: reduce-scatter then all-gather, 2(p-1) rounds of n/p: 2(p-1)alpha + 2((p-1)/p)n beta.
- halving_doubling (Rabenseifner): recursive halving reduce-scatter then recursive doubling
  all-gather over the largest power of two P <= p, 2 log2(P) rounds; the p - P extra ranks first
  fold their vector into a partner and get the result back (two more rounds of n).
- tree: binomial reduce to rank 0 then binomial broadcast, 2 ceil(log2 p) rounds of n
  (latency-optimal, for small messages; not pipelined).
- hierarchical (2-level): ring reduce-scatter inside each node, ring all-reduce across nodes on
  this rank's 1/G of the data, ring all-gather inside the node: inter-node bytes shrink by G.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ALGORITHMS = ("ring", "halving_doubling", "tree", "hierarchical")


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    lo: int
    hi: int
    reduce: bool


Round = tuple[Transfer, ...]


@dataclass(frozen=True)
class LinkCost:
    """A link's alpha-beta model: a message of n bytes takes ``alpha_s + n * beta_s_per_byte``.

    ``duplex``: a rank sends and receives at once at full rate (a NIC, NVLink). A half-duplex
    link is one whose messages go through the rank's own cores, as between CPU processes on one
    host: what a rank sends and receives in one round add up, latency and bytes (the one-way
    ping-pong that measures alpha and beta handles each message once on each side, the same as
    here).
    """

    alpha_s: float
    beta_s_per_byte: float
    duplex: bool = True

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class GroupLinks:
    """What a cost prediction needs about a group: each group rank's node and the two links."""

    nodes: tuple[int, ...]
    intra: LinkCost
    inter: LinkCost

    def link(self, a: int, b: int) -> LinkCost:
        return self.intra if self.nodes[a] == self.nodes[b] else self.inter


def _bounds(lo: int, hi: int, parts: int) -> list[int]:
    """Offsets of ``parts`` chunks of [lo, hi), the first ``(hi - lo) % parts`` one longer."""
    q, r = divmod(hi - lo, parts)
    out = [lo]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


def _ring_rounds(peers: tuple[int, ...], lo: int, hi: int, phase: str) -> list[list[Transfer]]:
    """Ring over ``peers`` on [lo, hi): ``"rs"`` leaves chunk i reduced on peers[i], ``"ag"``
    spreads chunk i from peers[i], ``"ar"`` is both."""
    p = len(peers)
    b = _bounds(lo, hi, p)
    rounds: list[list[Transfer]] = []
    if phase in ("rs", "ar"):
        for s in range(p - 1):
            rounds.append([])
            for i in range(p):
                c = (i - s - 1) % p
                rounds[-1].append(Transfer(peers[i], peers[(i + 1) % p], b[c], b[c + 1], True))
    if phase in ("ag", "ar"):
        for s in range(p - 1):
            rounds.append([])
            for i in range(p):
                c = (i - s) % p
                rounds[-1].append(Transfer(peers[i], peers[(i + 1) % p], b[c], b[c + 1], False))
    return rounds


def _halving_doubling_rounds(p: int, n: int) -> list[list[Transfer]]:
    big = 1 << (p.bit_length() - 1)
    extra = p - big
    real = [2 * v + 1 if v < extra else v + extra for v in range(big)]
    rounds = []
    if extra:  # fold: even rank 2i hands its vector to 2i + 1 and sits out
        rounds.append([Transfer(2 * i, 2 * i + 1, 0, n, True) for i in range(extra)])
    b = _bounds(0, n, big)
    span = [(0, big)] * big
    d = big // 2
    while d >= 1:  # recursive halving: keep the half named by bit d, send the other
        rounds.append([])
        new = []
        for v in range(big):
            lo, hi = span[v]
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if not v & d else ((mid, hi), (lo, mid))
            rounds[-1].append(Transfer(real[v], real[v ^ d], b[give[0]], b[give[1]], True))
            new.append(keep)
        span, d = new, d // 2
    d = 1
    while d < big:  # recursive doubling: swap owned blocks with the partner at distance d
        rounds.append(
            [
                Transfer(real[v], real[v ^ d], b[span[v][0]], b[span[v][1]], False)
                for v in range(big)
            ]
        )
        span = [
            (min(span[v][0], span[v ^ d][0]), max(span[v][1], span[v ^ d][1])) for v in range(big)
        ]
        d *= 2
    if extra:  # unfold: the result goes back to the ranks that sat out
        rounds.append([Transfer(2 * i + 1, 2 * i, 0, n, False) for i in range(extra)])
    return rounds


def _tree_rounds(p: int, n: int) -> list[list[Transfer]]:
    rounds = []
    mask = 1
    while mask < p:  # binomial reduce: a rank sends at the round of its lowest set bit
        rounds.append(
            [
                Transfer(r, r - mask, 0, n, True)
                for r in range(p)
                if r & mask and r & (mask - 1) == 0
            ]
        )
        mask <<= 1
    mask >>= 1
    while mask >= 1:  # binomial broadcast from rank 0, mirror image
        rounds.append(
            [Transfer(r, r + mask, 0, n, False) for r in range(0, p, 2 * mask) if r + mask < p]
        )
        mask >>= 1
    return rounds


def node_members(nodes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Group ranks per node, nodes in order of first appearance, ranks in group-rank order."""
    members: dict[int, list[int]] = {}
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)
    return [tuple(m) for m in members.values()]


def _merge(parts: list[list[list[Transfer]]]) -> list[list[Transfer]]:
    """Run several independent schedules side by side, round i with round i."""
    depth = max((len(x) for x in parts), default=0)
    return [[t for x in parts if i < len(x) for t in x[i]] for i in range(depth)]


def _hierarchical_rounds(n: int, nodes: tuple[int, ...]) -> list[list[Transfer]]:
    members = node_members(nodes)
    per_node = len(members[0])
    if any(len(m) != per_node for m in members):
        sizes = [len(m) for m in members]
        raise ValueError(
            f"hierarchical all_reduce needs the same number of ranks on every node, got {sizes}; "
            "use algorithm='ring' or 'halving_doubling'"
        )
    b = _bounds(0, n, per_node)
    rounds = _merge([_ring_rounds(m, 0, n, "rs") for m in members])
    cross = [tuple(m[j] for m in members) for j in range(per_node)]
    rounds += _merge([_ring_rounds(c, b[j], b[j + 1], "ar") for j, c in enumerate(cross)])
    rounds += _merge([_ring_rounds(m, 0, n, "ag") for m in members])
    return rounds


@functools.lru_cache(maxsize=256)
def schedule(
    algorithm: str, n: int, p: int, nodes: tuple[int, ...] | None = None
) -> tuple[Round, ...]:
    """The rounds of ``algorithm`` for ``n`` elements over ``p`` ranks (``nodes``: each group
    rank's node, needed by ``"hierarchical"``). Empty messages are dropped."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all_reduce algorithm {algorithm!r}; allowed: {ALGORITHMS}")
    if p < 1 or n < 0:
        raise ValueError(f"schedule needs p >= 1 ranks and n >= 0 elements, got p={p}, n={n}")
    if p == 1:
        return ()
    if algorithm == "ring":
        rounds = _ring_rounds(tuple(range(p)), 0, n, "ar")
    elif algorithm == "halving_doubling":
        rounds = _halving_doubling_rounds(p, n)
    elif algorithm == "tree":
        rounds = _tree_rounds(p, n)
    else:
        if nodes is None or len(nodes) != p:
            raise ValueError(f"hierarchical all_reduce needs the node of each of the {p} ranks")
        rounds = _hierarchical_rounds(n, nodes)
    kept = (tuple(t for t in r if t.hi > t.lo) for r in rounds)
    return tuple(r for r in kept if r)


def _round_seconds(r: Round | list[Transfer], links: GroupLinks, itemsize: int) -> float:
    """The slowest rank of a round: on duplex links its slowest message; on half-duplex ones
    its messages one after the other (each its latency and bytes)."""
    by_rank: dict[int, list[tuple[LinkCost, int]]] = {}
    for t in r:
        msg = (links.link(t.src, t.dst), (t.hi - t.lo) * itemsize)
        by_rank.setdefault(t.src, []).append(msg)
        by_rank.setdefault(t.dst, []).append(msg)
    slowest = 0.0
    for msgs in by_rank.values():
        half = [(link, n) for link, n in msgs if not link.duplex]
        took = max((link.seconds(n) for link, n in msgs if link.duplex), default=0.0)
        if half:  # the rank's core handles each message in turn: its latency and its bytes
            took = max(took, sum(link.seconds(n) for link, n in half))
        slowest = max(slowest, took)
    return slowest


def predict_seconds(algorithm: str, nbytes: int, itemsize: int, links: GroupLinks) -> float:
    """Predicted time of one all_reduce of ``nbytes`` under ``links``: the sum over rounds of
    the round's slowest rank (``LinkCost.duplex`` says how a rank's messages of a round add)."""
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a multiple of itemsize={itemsize}")
    p = len(links.nodes)
    rounds = schedule(algorithm, nbytes // itemsize, p, links.nodes)
    return sum(_round_seconds(r, links, itemsize) for r in rounds)


@functools.lru_cache(maxsize=1024)
def choose(nbytes: int, itemsize: int, links: GroupLinks) -> str:
    """The algorithm with the least predicted time (ties: the earlier in ``ALGORITHMS``).

    Remembered per (size, links): ``all_reduce(algorithm="auto")`` asks on every call, and
    pricing every schedule costs up to a millisecond at 8 ranks."""
    options = [a for a in ALGORITHMS if a != "hierarchical" or _uniform(links.nodes)]
    return min(options, key=lambda a: predict_seconds(a, nbytes, itemsize, links))


def _uniform(nodes: tuple[int, ...]) -> bool:
    return len({len(m) for m in node_members(nodes)}) == 1

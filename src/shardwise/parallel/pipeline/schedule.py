"""Pipeline schedules as data: per pp rank, an ordered list of actions.

An ``Action`` is one step of one rank: a forward (F) of micro-batch ``mb`` through stage ``stage``,
its backward (B: input and weight gradients together), or, for zero-bubble schedules, the two
halves of B apart (I: input gradient, W: weight gradient); or the point-to-point messages between
stages (send/recv of an activation or of a gradient). Stages are numbered globally
``0 .. num_stages - 1`` with ``num_stages = pp_size * virtual_stages``; stage ``s`` lives on rank
``s % pp_size`` (Narayanan et al. 2021, section 2.2: rank r holds chunks r, r + p, r + 2p, ...).

The same lists feed the simulator (``shardwise.parallel.pipeline.simulate``) and the executor, so
what the simulator proves (no deadlock, every action once) is what runs.

Messages between a pair of ranks are matched in order (the transport's FIFO per direction), so
receives are placed in each channel's send order, each as late as that order allows.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


class Kind(enum.Enum):
    """What an action does."""

    F = "F"  # forward of one micro-batch through one stage
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  backward, input gradient only (zero-bubble split)
    W = "W"  # backward, weight gradient only (zero-bubble split)
    SEND_ACT = "SEND_ACT"  # send the stage's output activation to the next stage
    RECV_ACT = "RECV_ACT"  # receive the previous stage's output activation
    SEND_GRAD = "SEND_GRAD"  # send the gradient of the stage's input to the previous stage
    RECV_GRAD = "RECV_GRAD"  # receive the gradient of the stage's output from the next stage

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)


@dataclass(frozen=True)
class Action:
    """One step of one rank. For messages, ``stage`` is the stage that produced the payload
    (the sender's stage) and ``peer`` the global pp rank at the other end."""

    kind: Kind
    stage: int
    mb: int
    peer: int = -1

    def __str__(self) -> str:
        if self.kind.is_compute:
            return f"{self.kind.value}{self.mb}@s{self.stage}"
        return f"{self.kind.value.lower()}{self.mb}@s{self.stage}->r{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """The action lists of every pp rank for one step."""

    name: str
    pp_size: int
    virtual_stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]  # actions[r]: rank r's list, in order

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.pp_size))

    @property
    def split_backward(self) -> bool:
        return any(a.kind is Kind.I for acts in self.actions for a in acts)


def _check_args(name: str, pp_size: int, microbatches: int, virtual_stages: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    for what, value in (
        ("pp_size", pp_size),
        ("microbatches", microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    if name != "interleaved_1f1b" and virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank; virtual_stages={virtual_stages} needs "
            "schedule 'interleaved_1f1b'"
        )
    if name == "interleaved_1f1b" and microbatches % pp_size:
        raise ValueError(
            f"interleaved_1f1b needs microbatches divisible by the pp size: got "
            f"microbatches={microbatches}, pp={pp_size}; use a multiple of {pp_size}"
        )


def _gpipe(pp_size: int, microbatches: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (Huang et al. 2018)."""
    fwd = [Action(Kind.F, rank, i) for i in range(microbatches)]
    return fwd + [Action(Kind.B, rank, i) for i in range(microbatches)]


def _one_f_one_b(pp_size: int, microbatches: int, rank: int) -> list[Action]:
    """Warm-up of p - r - 1 forwards, then one forward / one backward, then the backwards left
    (Narayanan et al. 2021, section 2.2, PipeDream-Flush)."""
    warmup = min(pp_size - rank - 1, microbatches)
    out = [Action(Kind.F, rank, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        out += [Action(Kind.F, rank, warmup + i), Action(Kind.B, rank, i)]
    out += [Action(Kind.B, rank, i) for i in range(microbatches - warmup, microbatches)]
    return out


def _interleaved(pp_size: int, microbatches: int, rank: int, v: int) -> list[Action]:
    """Interleaved 1F1B over v chunks per rank (Narayanan et al. 2021, section 2.2.1): the k-th
    forward works on chunk (k // p) % v, micro-batch (k // (p v)) p + k % p; backwards run the
    chunks in reverse. Warm-up is 2 (p - r - 1) + (v - 1) p forwards."""
    p, total = pp_size, microbatches * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return (chunk if forward else v - 1 - chunk) * p + rank, mb

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    out = [Action(Kind.F, *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        out.append(Action(Kind.F, *unit(warmup + k, True)))
        out.append(Action(Kind.B, *unit(k, False)))
    out += [Action(Kind.B, *unit(k, False)) for k in range(total - warmup, total)]
    return out


def _zb_h1(pp_size: int, microbatches: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, section 3.1): 1F1B's order and memory with the backward split into
    input gradient (I) and weight gradient (W). Rank r runs its first W after r steady-state
    pairs, so its W's fill the slots where 1F1B waits in its cool-down and at most p
    micro-batches' activations (counted until their W) are held on any rank."""
    p, m = pp_size, microbatches
    warmup = min(p - rank - 1, m)
    out = [Action(Kind.F, rank, i) for i in range(warmup)]
    delay = rank
    next_w = 0
    for i in range(m - warmup):
        out += [Action(Kind.F, rank, warmup + i), Action(Kind.I, rank, i)]
        if i >= delay:
            out.append(Action(Kind.W, rank, next_w))
            next_w += 1
    for i in range(m - warmup, m):
        out.append(Action(Kind.I, rank, i))
        out.append(Action(Kind.W, rank, next_w))
        next_w += 1
    out += [Action(Kind.W, rank, i) for i in range(next_w, m)]
    return out


def schedule_from_compute(
    name: str, compute: list[list[Action]], microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """A schedule from each rank's compute order (F/B or F/I/W actions); the sends and receives
    are derived. Check it with ``simulate`` (the executor does before running it)."""
    pp_size = len(compute)
    full = _with_messages(compute, pp_size, pp_size * virtual_stages)
    rows = tuple(tuple(acts) for acts in full)
    return Schedule(name, pp_size, virtual_stages, microbatches, rows)


def _with_messages(
    compute: list[list[Action]], pp_size: int, num_stages: int
) -> list[list[Action]]:
    """Insert sends right after the compute producing the payload, and receives before the
    compute consuming it, in each channel's send order (messages on a channel are FIFO)."""
    use_index = {(a.kind, a.stage, a.mb): idx for acts in compute for idx, a in enumerate(acts)}
    sends_after: list[dict[int, list[Action]]] = [{} for _ in range(pp_size)]
    channels: dict[tuple[int, int], list[tuple[Action, int]]] = {}  # (src, dst) -> [(recv, use)]
    for r, acts in enumerate(compute):
        for idx, a in enumerate(acts):
            msg = _message_of(a, pp_size, num_stages)
            if msg is not None:
                send, recv, consumer = msg
                sends_after[r].setdefault(idx, []).append(send)
                channels.setdefault((r, send.peer), []).append((recv, use_index[consumer]))
    recvs_before: list[dict[int, list[Action]]] = [{} for _ in range(pp_size)]
    for (_, dst), items in channels.items():
        latest, placed = len(compute[dst]), []
        for recv, use in reversed(items):  # each recv no later than the next one on the channel
            latest = min(latest, use)
            placed.append((latest, recv))
        for pos, recv in reversed(placed):
            recvs_before[dst].setdefault(pos, []).append(recv)
    result = []
    for r, acts in enumerate(compute):
        seq: list[Action] = []
        for idx, a in enumerate(acts):
            seq += [*recvs_before[r].get(idx, []), a, *sends_after[r].get(idx, [])]
        result.append(seq)
    return result


def _message_of(
    a: Action, pp_size: int, num_stages: int
) -> tuple[Action, Action, tuple[Kind, int, int]] | None:
    """(send on this rank, matching recv on the peer, the peer's consuming compute) or None."""
    src = a.stage % pp_size
    if a.kind is Kind.F and a.stage + 1 < num_stages:
        nxt = a.stage + 1
        dst = nxt % pp_size
        if dst == src:
            return None
        send = Action(Kind.SEND_ACT, a.stage, a.mb, dst)
        return send, Action(Kind.RECV_ACT, a.stage, a.mb, src), (Kind.F, nxt, a.mb)
    if a.kind in (Kind.B, Kind.I) and a.stage > 0:
        prev = a.stage - 1
        dst = prev % pp_size
        if dst == src:
            return None
        send = Action(Kind.SEND_GRAD, a.stage, a.mb, dst)
        return send, Action(Kind.RECV_GRAD, a.stage, a.mb, src), (a.kind, prev, a.mb)
    return None


_GENERATORS: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "zb_h1": _zb_h1,
}


def build_schedule(name: str, pp_size: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Every pp rank's action list for schedule ``name`` (one of ``SCHEDULES``).

    ``interleaved_1f1b`` needs ``microbatches % pp_size == 0``; the others take any
    ``microbatches >= 1`` (fewer micro-batches than stages run, with a larger bubble).
    """
    _check_args(name, pp_size, microbatches, virtual_stages)
    if name == "interleaved_1f1b":
        compute = [_interleaved(pp_size, microbatches, r, virtual_stages) for r in range(pp_size)]
    else:
        compute = [_GENERATORS[name](pp_size, microbatches, r) for r in range(pp_size)]
    return schedule_from_compute(name, compute, microbatches, virtual_stages)

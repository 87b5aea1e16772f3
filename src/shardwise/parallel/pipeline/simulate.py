"""Run a schedule's action lists on a model of the machine, before anything runs for real.

Each rank executes its list in order. A compute action takes its time (F: ``t_fwd``; B:
``t_bwd + t_wgrad``; I: ``t_bwd``; W: ``t_wgrad``, all per micro-batch per stage); a send costs
the sender nothing and arrives ``t_p2p`` later; a receive blocks until the next message on its
channel has arrived and must be the one it expects (channels are FIFO, as the transport is).
The run is deterministic (a Kahn process network), so the result does not depend on the order
in which ranks are stepped.

It proves what the executor relies on: every action's inputs exist when it runs, every
F/B/I/W happens exactly once, the receives match the sends in order, and nothing deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from shardwise.parallel.pipeline.schedule import Action, Kind, Schedule, build_schedule

Number = Any  # int, float or Fraction: the simulator only adds and compares times

MAX_STAGE_MICROBATCHES = 16384
"""Most (pipeline stage, micro-batch) pairs one simulation runs: pp x virtual stages x
micro-batches. The schedule is built and run action by action; this bound keeps it within
seconds."""


class ScheduleError(ValueError):
    """A schedule that cannot run: it deadlocks, skips or repeats an action, or uses an input
    before it exists."""


@dataclass
class Slot:
    """One compute action on the timeline of a rank."""

    start: Number
    end: Number
    action: Action


@dataclass
class SimResult:
    """What a simulated step looks like."""

    schedule: Schedule
    makespan: Number  # step time: the last rank's end
    busy: list[Number]  # per rank: time spent computing
    timeline: list[list[Slot]]  # per rank: compute actions in order
    peak_inflight: list[int]  # per rank: most stage-micro-batch activations held at once

    @property
    def bubble(self) -> Number:
        """Idle time over compute time, summed over ranks ((p-1)/m for 1F1B in unit time)."""
        total = sum(self.busy)
        return _ratio(self.makespan * len(self.busy) - total, total)

    def bubble_of(self, rank: int) -> Number:
        return _ratio(self.makespan - self.busy[rank], self.busy[rank])

    def peak_activations(self, rank: int) -> Fraction:
        """Peak in-flight activations of ``rank`` in units of one micro-batch through all of the
        rank's layers (a chunk of an interleaved schedule holds 1/v of that)."""
        return Fraction(self.peak_inflight[rank], self.schedule.virtual_stages)


def _ratio(a: Number, b: Number) -> Number:
    """a / b, exact (a Fraction) when both are ints or Fractions."""
    if isinstance(a, (int, Fraction)) and isinstance(b, (int, Fraction)):
        return Fraction(a) / Fraction(b)
    return a / b


@dataclass
class _Rank:
    actions: tuple[Action, ...]
    pos: int = 0
    clock: Number = 0
    inflight: int = 0
    peak: int = 0
    busy: Number = 0
    have: set[tuple[str, int, int]] = field(default_factory=set)
    slots: list[Slot] = field(default_factory=list)


def _durations(t_fwd: Number, t_bwd: Number, t_wgrad: Number) -> dict[Kind, Number]:
    for name, value in (("t_fwd", t_fwd), ("t_bwd", t_bwd), ("t_wgrad", t_wgrad)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if t_fwd + t_bwd + t_wgrad == 0:  # no compute: the bubble (idle over busy) is 0 / 0
        raise ValueError("t_fwd, t_bwd and t_wgrad are all 0: give at least one a time > 0")
    return {Kind.F: t_fwd, Kind.B: t_bwd + t_wgrad, Kind.I: t_bwd, Kind.W: t_wgrad}


def _needs(a: Action, s: Schedule) -> list[tuple[str, int, int]]:
    """What must exist on the rank before ``a`` runs."""
    last = s.num_stages - 1
    if a.kind is Kind.F:
        return [] if a.stage == 0 else [("act", a.stage - 1, a.mb)]
    if a.kind in (Kind.B, Kind.I):
        out = [("fwd", a.stage, a.mb)]
        return out if a.stage == last else [*out, ("grad", a.stage + 1, a.mb)]
    if a.kind is Kind.W:
        return [("igrad", a.stage, a.mb)]
    if a.kind is Kind.SEND_ACT:
        return [("act", a.stage, a.mb)]
    if a.kind is Kind.SEND_GRAD:
        return [("grad", a.stage, a.mb)]
    return []


def _produces(a: Action) -> list[tuple[str, int, int]]:
    if a.kind is Kind.F:
        return [("fwd", a.stage, a.mb), ("act", a.stage, a.mb)]
    if a.kind in (Kind.B, Kind.I):
        return [("igrad", a.stage, a.mb), ("grad", a.stage, a.mb)]
    if a.kind is Kind.RECV_ACT:
        return [("act", a.stage, a.mb)]
    if a.kind is Kind.RECV_GRAD:
        return [("grad", a.stage, a.mb)]
    return []


def _step(
    r: int,
    st: _Rank,
    s: Schedule,
    chans: dict[tuple[int, int], deque[tuple[Action, Number]]],
    dur: dict[Kind, Number],
    t_p2p: Number,
) -> bool:
    """Run rank ``r``'s next action if it can; False when blocked on a receive."""
    a = st.actions[st.pos]
    missing = [n for n in _needs(a, s) if n not in st.have]
    if missing:
        raise ScheduleError(f"rank {r} runs {a} (action {st.pos}) before it has {missing[0]}")
    if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
        chan = chans.setdefault((a.peer, r), deque())
        if not chan:
            return False
        sent, arrival = chan.popleft()
        expect = Kind.SEND_ACT if a.kind is Kind.RECV_ACT else Kind.SEND_GRAD
        if (sent.kind, sent.stage, sent.mb) != (expect, a.stage, a.mb):
            raise ScheduleError(
                f"rank {r} expects {a} but the next message from rank {a.peer} is {sent}"
            )
        st.clock = max(st.clock, arrival)
    elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
        chans.setdefault((r, a.peer), deque()).append((a, st.clock + t_p2p))
    else:
        end = st.clock + dur[a.kind]
        st.slots.append(Slot(st.clock, end, a))
        st.busy += dur[a.kind]
        st.clock = end
        st.inflight += {Kind.F: 1, Kind.B: -1, Kind.I: -1}.get(a.kind, 0)
        st.peak = max(st.peak, st.inflight)
    st.have.update(_produces(a))
    st.pos += 1
    return True


def _check_complete(s: Schedule) -> None:
    """Every stage's F and B (or I and W) of every micro-batch, exactly once, on its rank."""
    split = s.split_backward
    kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
    seen: dict[tuple[Kind, int, int], int] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if not a.kind.is_compute:
                continue
            if a.kind not in kinds:
                raise ScheduleError(f"rank {r} runs {a}; a schedule uses B or I+W, not both")
            if s.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r} runs {a} but stage {a.stage} lives on another rank")
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise ScheduleError(f"rank {r} runs {a} twice")
            seen[key] = r
    for stage in range(s.num_stages):
        for mb in range(s.microbatches):
            for k in kinds:
                if (k, stage, mb) not in seen:
                    raise ScheduleError(f"no rank runs {k.value}{mb}@s{stage}")


def check_size(stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Refuse a simulation beyond ``MAX_STAGE_MICROBATCHES`` (before building its schedule)."""
    units = stages * virtual_stages * microbatches
    if units > MAX_STAGE_MICROBATCHES:
        raise ValueError(
            f"{stages} stages x {virtual_stages} virtual x {microbatches} micro-batches = "
            f"{units:,} to simulate, more than {MAX_STAGE_MICROBATCHES:,} (a few seconds): "
            "lower the stages or the micro-batches"
        )


def run_schedule(
    s: Schedule,
    t_fwd: Number = 1,
    t_bwd: Number = 1,
    t_wgrad: Number = 1,
    t_p2p: Number = 0,
) -> SimResult:
    """Simulate ``s``; raises ScheduleError naming the ranks if it deadlocks or is invalid,
    ValueError beyond ``MAX_STAGE_MICROBATCHES``."""
    check_size(s.pp_size, s.microbatches, s.virtual_stages)
    _check_complete(s)
    dur = _durations(t_fwd, t_bwd, t_wgrad)
    ranks = [_Rank(acts) for acts in s.actions]
    chans: dict[tuple[int, int], deque[tuple[Action, Number]]] = {}
    # A worklist, not passes over every rank: a blocked rank is stepped again only once a
    # message is sent to it, so the run costs one visit per action (a pass per message would
    # cost ranks x actions).
    ready, queued = deque(range(len(ranks))), set(range(len(ranks)))
    while ready:
        r = ready.popleft()
        queued.discard(r)
        st = ranks[r]
        while st.pos < len(st.actions) and _step(r, st, s, chans, dur, t_p2p):
            done = st.actions[st.pos - 1]
            if done.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) and done.peer not in queued:
                ready.append(done.peer)
                queued.add(done.peer)
    stuck = [(r, st.actions[st.pos]) for r, st in enumerate(ranks) if st.pos < len(st.actions)]
    if stuck:
        waits = "; ".join(f"rank {r} waits in {a}" for r, a in stuck)
        raise ScheduleError(f"schedule {s.name} deadlocks: {waits}")
    left = [(k, len(q)) for k, q in chans.items() if q]
    if left:
        raise ScheduleError(f"messages sent but never received on channels {left}")
    return SimResult(
        schedule=s,
        makespan=max(st.clock for st in ranks),
        busy=[st.busy for st in ranks],
        timeline=[st.slots for st in ranks],
        peak_inflight=[st.peak for st in ranks],
    )


def simulate(
    schedule: str | Schedule,
    stages: int | None = None,
    microbatches: int | None = None,
    *,
    virtual_stages: int = 1,
    t_fwd: Number = 1,
    t_bwd: Number = 1,
    t_wgrad: Number = 1,
    t_p2p: Number = 0,
) -> SimResult:
    """Simulate one step of a pipeline schedule.

    ``schedule`` is a name from ``SCHEDULES`` (then ``stages`` = pp ranks and ``microbatches``
    are required) or a ``Schedule``. Times are per micro-batch per stage (per chunk for an
    interleaved schedule): ``t_fwd`` the forward, ``t_bwd`` the input-gradient backward,
    ``t_wgrad`` the weight-gradient backward (a schedule without the split runs both as one B),
    ``t_p2p`` one message. Pass ``Fraction``s or ints for exact bubbles.
    """
    if isinstance(schedule, str):
        if stages is None or microbatches is None:
            raise ValueError("simulate by schedule name needs stages= and microbatches=")
        check_size(stages, microbatches, virtual_stages)
        schedule = build_schedule(schedule, stages, microbatches, virtual_stages)
    elif not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a name or a Schedule, got {type(schedule).__name__}")
    return run_schedule(schedule, t_fwd, t_bwd, t_wgrad, t_p2p)

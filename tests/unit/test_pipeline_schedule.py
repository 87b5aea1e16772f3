"""Pipeline schedules as data and the simulator that runs them (no processes)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from shardwise.parallel.pipeline import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    simulate,
)
from shardwise.parallel.pipeline.simulate import run_schedule

P_MAX, V_MAX, M_MAX = 8, 4, 16


def _cases() -> list[tuple[str, int, int, int]]:
    out = []
    for p in range(1, P_MAX + 1):
        for m in range(1, M_MAX + 1):
            out += [("gpipe", p, 1, m), ("1f1b", p, 1, m), ("zb_h1", p, 1, m)]
            if m % p == 0:
                out += [("interleaved_1f1b", p, v, m) for v in range(1, V_MAX + 1)]
    return out


def _formula(name: str, p: int, v: int, m: int) -> Fraction:
    return {
        "gpipe": Fraction(p - 1, m),
        "1f1b": Fraction(p - 1, m),
        "interleaved_1f1b": Fraction(p - 1, v * m),
        "zb_h1": Fraction(p - 1, 3 * m),
    }[name]


def _compute_counts(s: Schedule) -> dict[tuple[Kind, int, int], int]:
    counts: dict[tuple[Kind, int, int], int] = {}
    for acts in s.actions:
        for a in acts:
            if a.kind.is_compute:
                key = (a.kind, a.stage, a.mb)
                counts[key] = counts.get(key, 0) + 1
    return counts


def test_unit_time_bubbles_equal_the_formulas_everywhere() -> None:
    """p <= 8, v <= 4, m <= 16: no deadlock, every action exactly once, exact bubbles (ZB-H1's
    (p-1)/(3m) holds from m >= p; below it the cool-down has nothing to fill)."""
    checked = 0
    for name, p, v, m in _cases():
        res = simulate(name, p, m, virtual_stages=v)  # raises ScheduleError on a deadlock
        counts = _compute_counts(res.schedule)
        kinds = (Kind.F, Kind.I, Kind.W) if name == "zb_h1" else (Kind.F, Kind.B)
        expected = {(k, s, i) for k in kinds for s in range(p * v) for i in range(m)}
        assert set(counts) == expected and set(counts.values()) == {1}, (name, p, v, m)
        assert sum(len(row) for row in res.timeline) == len(expected)
        if name != "zb_h1" or m >= p:
            assert res.bubble == _formula(name, p, v, m), (name, p, v, m, res.bubble)
            checked += 1
    assert checked == 524  # every (schedule, p, v, m) above where the formula applies


@pytest.mark.parametrize("p", range(1, P_MAX + 1))
def test_peak_inflight_activations(p: int) -> None:
    for m in range(1, M_MAX + 1):
        gpipe = simulate("gpipe", p, m)
        one = simulate("1f1b", p, m)
        zb = simulate("zb_h1", p, m)
        for r in range(p):
            assert gpipe.peak_inflight[r] == m
            assert one.peak_inflight[r] == min(p - r, m)
            assert zb.peak_inflight[r] == min(p - r, m)


def test_interleaved_peak_matches_megatron_formula() -> None:
    """Rank 0 holds p (1 + (p-1)/(p v)) micro-batches of its layers once warm-up fits."""
    for p in range(2, 6):
        for v in range(2, V_MAX + 1):
            for m in (p, 2 * p, 4 * p):
                warmup = 2 * (p - 1) + (v - 1) * p
                if warmup >= m * v:
                    continue
                res = simulate("interleaved_1f1b", p, m, virtual_stages=v)
                want = p * (1 + Fraction(p - 1, p * v))
                assert res.peak_activations(0) == want, (p, v, m)


def test_bubble_with_uneven_times_and_p2p() -> None:
    """GPipe's step: (m + p - 1)(t_f + t_b + t_w) plus 2(p-1) messages on the critical path."""
    t_f, t_b, t_w, t_c = Fraction(2), Fraction(3), Fraction(1), Fraction(1, 4)
    for p, m in ((2, 3), (4, 8), (3, 1)):
        res = simulate("gpipe", p, m, t_fwd=t_f, t_bwd=t_b, t_wgrad=t_w, t_p2p=t_c)
        assert res.makespan == (m + p - 1) * (t_f + t_b + t_w) + 2 * (p - 1) * t_c
        assert res.busy == [m * (t_f + t_b + t_w)] * p


def test_messages_pair_up_in_channel_order() -> None:
    s = build_schedule("interleaved_1f1b", 2, 4, virtual_stages=3)
    for src in range(2):
        for dst in range(2):
            if src == dst:
                continue
            sent = [
                (a.kind.value[5:], a.stage, a.mb)
                for a in s.actions[src]
                if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) and a.peer == dst
            ]
            got = [
                (a.kind.value[5:], a.stage, a.mb)
                for a in s.actions[dst]
                if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and a.peer == src
            ]
            assert sent == got and sent


def test_one_rank_has_no_messages() -> None:
    s = build_schedule("interleaved_1f1b", 1, 3, virtual_stages=2)
    assert all(a.kind.is_compute for a in s.actions[0])
    assert simulate(s).bubble == 0


def _edited(s: Schedule, rank: int, acts: list[Action]) -> Schedule:
    rows = list(s.actions)
    rows[rank] = tuple(acts)
    return Schedule(s.name, s.pp_size, s.virtual_stages, s.microbatches, tuple(rows))


def test_deadlock_is_detected_and_named() -> None:
    s = build_schedule("1f1b", 2, 2)
    r1 = list(s.actions[1])
    # rank 1 sends its first gradient only after its second forward, which needs rank 0's second
    # activation; rank 0 sends that only after the first gradient: a cycle.
    acts = [a for a in s.actions[0] if not (a.kind is Kind.F and a.mb == 1)]
    acts = [a for a in acts if not (a.kind is Kind.SEND_ACT and a.mb == 1)]
    i = next(k for k, a in enumerate(acts) if a.kind is Kind.B and a.mb == 0)
    acts[i + 1 : i + 1] = [Action(Kind.F, 0, 1), Action(Kind.SEND_ACT, 0, 1, 1)]
    first_send = next(k for k, a in enumerate(r1) if a.kind is Kind.SEND_GRAD)
    moved = r1.pop(first_send)
    r1.insert(len(r1) - 1, moved)
    bad = _edited(_edited(s, 0, acts), 1, r1)
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits in recv_grad0@s1"):
        run_schedule(bad)


def test_missing_repeated_and_misplaced_actions_are_refused() -> None:
    s = build_schedule("gpipe", 2, 2)
    r0 = list(s.actions[0])
    with pytest.raises(ScheduleError, match="no rank runs B1@s0"):
        run_schedule(_edited(s, 0, [a for a in r0 if a != Action(Kind.B, 0, 1)]))
    with pytest.raises(ScheduleError, match="twice"):
        run_schedule(_edited(s, 0, [*r0, Action(Kind.F, 0, 0)]))
    with pytest.raises(ScheduleError, match="lives on another rank"):
        run_schedule(_edited(s, 0, [*r0, Action(Kind.F, 1, 5)]))
    early = [Action(Kind.B, 0, 0), *[a for a in r0 if a != Action(Kind.B, 0, 0)]]
    with pytest.raises(ScheduleError, match="before it has"):
        run_schedule(_edited(s, 0, early))


def test_out_of_order_receives_are_refused() -> None:
    s = build_schedule("gpipe", 2, 2)
    r1 = list(s.actions[1])
    i, j = (k for k, a in enumerate(r1) if a.kind is Kind.RECV_ACT)
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(ScheduleError, match="expects recv_act1@s0->r0 but the next message"):
        run_schedule(_edited(s, 1, r1))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'; allowed: gpipe"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="divisible by the pp size"):
        build_schedule("interleaved_1f1b", 4, 6, virtual_stages=2)
    with pytest.raises(ValueError, match="needs schedule 'interleaved_1f1b'"):
        build_schedule("1f1b", 4, 8, virtual_stages=2)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        build_schedule("1f1b", 4, 0)
    with pytest.raises(ValueError, match="needs stages= and microbatches="):
        simulate("1f1b")
    with pytest.raises(ValueError, match="t_fwd must be >= 0"):
        simulate("1f1b", 2, 2, t_fwd=-1)

"""Calibrating the cost model on the ranks that will train, within a time budget: per-rank
compute from the model's own one-rank step run on every rank at once (the cores as busy as in
the run), memory bandwidth from a copy, point-to-point links (``topology.discover``), each
collective's ring step (``calibrate.fit_collectives``) and the sync loss
(``calibrate.measure_sync_loss``). The result is a ``Hardware`` and what each part cost.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.comm import Group, ops
from shardwise.comm.allreduce_rounds import LinkCost
from shardwise.costmodel import calibrate
from shardwise.costmodel.hardware import Hardware, measure_memory_bandwidth, measured
from shardwise.costmodel.plan import Plan
from shardwise.costmodel.predict import predict
from shardwise.costmodel.shapes import ModelShape

QUICK_BUDGET_S = 20.0
"""Below this budget the collectives and the sync loss are timed with fewer sizes and turns."""


@dataclass(frozen=True)
class ComputeProbe:
    """Timed callables: one training step of ``micro_batch`` sequences of the model on one rank
    alone (no communication), at ``precision``, as one micro-batch (``step``) and as
    ``micro_batch`` micro-batches of one sequence (``split``, None: not timed): the difference
    is the overhead of the extra micro-batches."""

    step: Callable[[], object]
    micro_batch: int
    precision: str
    split: Callable[[], object] | None = None


@dataclass
class Calibration:
    """Measured hardware and the seconds each part of its measurement took."""

    hardware: Hardware
    spent_s: dict[str, float] = field(default_factory=dict)
    budget_s: float = 0.0
    host_bw_bytes_per_s: float = 0.0  # device-host copies (CUDA only; 0 on a CPU)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": hardware_record(self.hardware),
            "spent_s": dict(self.spent_s),
            "budget_s": self.budget_s,
            "host_bw_bytes_per_s": self.host_bw_bytes_per_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        return cls(
            hardware_from_record(data["hardware"]),
            dict(data["spent_s"]),
            float(data["budget_s"]),
            float(data.get("host_bw_bytes_per_s", 0.0)),
        )

    def describe(self) -> str:
        hw = self.hardware
        total = sum(self.spent_s.values())
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.spent_s.items())
        over = "" if total <= self.budget_s else " (over the budget)"
        link = f"p2p {hw.intra.alpha_s * 1e6:.0f} us + {_gbs(hw.intra)} GB/s"
        return (
            f"calibrated in {total:.1f} s of a {self.budget_s:g} s budget{over} ({parts}): "
            f"{hw.peak_flops / 1e9:.2f} GFLOP/s per rank, memory "
            f"{hw.memory_bw_bytes_per_s / 1e9:.1f} GB/s, {link}, sync loss {hw.sync_loss:.1%}, "
            f"{hw.micro_batch_overhead_s * 1e3:.1f} ms per micro-batch"
        )


def _gbs(link: LinkCost) -> str:
    return "inf" if link.beta_s_per_byte <= 0 else f"{1 / link.beta_s_per_byte / 1e9:.2f}"


def _link(d: Mapping[str, Any]) -> LinkCost:
    return LinkCost(float(d["alpha_s"]), float(d["beta_s_per_byte"]), bool(d["duplex"]))


def hardware_record(hw: Hardware) -> dict[str, Any]:
    """A ``Hardware`` as JSON (``hardware_from_record`` reads it back)."""
    return dataclasses.asdict(hw)


def hardware_from_record(d: Mapping[str, Any]) -> Hardware:
    values = dict(d)
    values["intra"], values["inter"] = _link(d["intra"]), _link(d["inter"])
    values["collectives"] = {k: _link(v) for k, v in d["collectives"].items()}
    return Hardware(**values)


def _slowest(group: Group, seconds: float) -> float:
    took = torch.tensor([seconds], dtype=torch.float64, device=group.world.device)
    ops.all_reduce(took, "max", group=group)
    return float(took.item())


WARM_TOLERANCE = 0.05
"""Warm-up ends when two consecutive step timings agree within this fraction."""
WARM_SHARE = 0.5
"""At most this share of a probe's budget goes to warming up."""


def warmed_up(times: Sequence[float], tolerance: float = WARM_TOLERANCE) -> bool:
    """Whether ``times`` (seconds of consecutive steps) ends warm: its last two timings agree
    within ``tolerance`` of the smaller. A cold start (first-call allocation, page faults,
    thread pools spinning up, a fresh process's caches) makes the first steps several times
    slower, and a compute rate fitted to them picks slow layouts."""
    if len(times) < 2:
        return False
    a, b = times[-2], times[-1]
    return abs(a - b) <= tolerance * min(a, b)


def _timed(step: Callable[[], object], group: Group) -> float:
    """Seconds of one ``step``, every rank starting at once."""
    dev = group.world.device
    ops.barrier(group=group)
    t0 = calibrate._clock(dev)
    step()
    return calibrate._clock(dev) - t0


def _any(group: Group, *flags: bool) -> list[bool]:
    """Each flag, true if it is true on any rank (every rank gets the same answer)."""
    t = torch.tensor([float(f) for f in flags], device=group.world.device)
    ops.all_reduce(t, "max", group=group)
    return [bool(v > 0) for v in t.tolist()]


def _time_probe(step: Callable[[], object], group: Group, budget_s: float) -> float:
    """Median seconds of ``step`` once warm (at least 3 timed, as many as ``budget_s`` allows
    up to 10), the slowest rank's; every rank steps at once. Warm-up: steps until two
    consecutive timings agree on every rank (``warmed_up``), within ``WARM_SHARE`` of the
    budget; every rank runs the same number of steps."""
    dev = group.world.device
    start = time.perf_counter()
    warm: list[float] = []
    while True:
        warm.append(_timed(step, group))
        over = time.perf_counter() - start >= WARM_SHARE * budget_s
        cold, over = _any(group, not warmed_up(warm), over)
        if not cold or over:
            break
    times: list[float] = []
    while len(times) < 10:  # the warm-up's time counts against the budget
        times.append(_timed(step, group))
        # rank 0's clock decides, so every rank runs the same number of steps
        more = torch.tensor([float(time.perf_counter() - start < budget_s)], device=dev)
        ops.broadcast(more, src=0, group=group)
        if len(times) >= 3 and not more.item():
            break
    return _slowest(group, statistics.median(times))


def _host_bandwidth(dev: torch.device, nbytes: int = 64 << 20) -> float:
    """Bytes/s of a pinned host-to-device copy (CUDA only; 0 elsewhere)."""
    if not torch.cuda.is_available() or dev.type != "cuda":
        return 0.0
    src = torch.ones(nbytes // 4, pin_memory=True)
    dst = torch.empty(nbytes // 4, device=dev)
    best = float("inf")
    for i in range(4):
        t0 = calibrate._clock(dev)
        dst.copy_(src, non_blocking=True)
        if i:
            best = min(best, calibrate._clock(dev) - t0)
    return nbytes / best


def calibrate_ranks(
    group: Group,
    shape: ModelShape,
    probe: ComputeProbe,
    budget_s: float,
    devices_per_node: int,
    memory_bytes: int,
) -> Calibration:
    """Measure the ``Hardware`` of ``group``'s ranks for ``shape`` in about ``budget_s``
    seconds (collective: every rank calls it and gets the same result).

    Compute: the probe's step time gives FLOP/s by the cost model's count of its FLOPs (less
    the optimizer's streaming at the measured memory bandwidth). On a CPU backend nothing
    overlaps (``overlap=False``). Communicates: barriers, the timed collectives and messages.
    """
    spent: dict[str, float] = {}
    t0 = time.perf_counter()
    membw = _slowest(group, measure_memory_bandwidth(group.world.device))
    host_bw = _host_bandwidth(group.world.device)
    spent["memory"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    share = 0.15 if probe.split is not None else 0.3
    step_s = _time_probe(probe.step, group, share * budget_s)
    overhead = 0.0
    if probe.split is not None and probe.micro_batch > 1:
        split_s = _time_probe(probe.split, group, share * budget_s)
        overhead = max(0.0, (split_s - step_s) / (probe.micro_batch - 1))
    spent["compute"] = time.perf_counter() - t0
    plan = Plan(micro_batch=probe.micro_batch, precision=probe.precision)
    unit = measured((LinkCost(0, 0), LinkCost(0, 0)), 1, 1.0, 1 << 62, membw)
    base = predict(shape, plan, unit)  # compute seconds at 1 FLOP/s = the step's FLOPs
    busy = step_s - base.breakdown["optimizer"] - overhead
    flops = base.breakdown["compute"] / max(busy, 0.1 * step_s)
    intra = inter = LinkCost(0.0, 0.0)
    fits: dict[str, LinkCost] = {}
    sync = 0.0
    if group.size > 1:
        from shardwise.topology import discover

        quick = budget_s < QUICK_BUDGET_S
        t0 = time.perf_counter()
        links = discover(group, reps=3 if quick else 10).links()
        intra, inter = links.intra, links.inter
        spent["links"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        sizes = (1 << 20, 4 << 20) if quick else (1 << 20, 4 << 20, 16 << 20)
        fits = calibrate.fit_collectives(group, sizes, iters=2 if quick else 3)
        spent["collectives"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        segments = (0.02,) if quick else (0.02, 0.05)
        sync = calibrate.measure_sync_loss(group, segments, reps=3, rounds=1 if quick else 2)
        spent["sync_loss"] = time.perf_counter() - t0
    overlap = group.world.device.type == "cuda"
    hw = measured(
        (intra, inter),
        devices_per_node,
        flops,
        memory_bytes,
        membw,
        collectives=fits,
        overlap=overlap,
        sync_loss=min(sync, 0.9),
        micro_batch_overhead_s=overhead,
    )
    return Calibration(hw, spent, budget_s, host_bw)

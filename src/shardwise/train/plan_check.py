"""The run checks the cost model: an ``--auto`` run's ``plan.json`` holds the chosen layout and
its predicted step; each step record gets ``predicted_step_time_s`` beside the measured
``step_time_s``, ``summary.json`` gets ``plan`` (predicted and measured, per term), and a
prediction off by more than ``TOLERANCE`` after the warm-up logs one warning naming the term
that missed most.

Measured terms of a step (medians over the steps after ``WARMUP_STEPS``): ``optimizer`` is the
timed optimizer step (not separable under a pipeline: it stays in compute there); ``bubble``
the pipeline's measured bubble share of the step (its waits on messages included); the exposed
communication (the least any rank was blocked on it: the slowest rank's, which does not wait
for the others) is ``p2p`` in the share of rank 0's time in send/recv, the rest ``tp`` when
dp = 1, ``dp`` when tp = 1, else split between them as predicted; ``compute`` is what
remains of the step.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

log = logging.getLogger("shardwise.train")

PLAN_NAME = "plan.json"
WARMUP_STEPS = 3
"""Steps left out of the comparison (allocation, first-call costs, caches)."""
CHECK_AFTER = 5
"""Steps after the warm-up whose median is checked against the prediction."""
TOLERANCE = 0.25
TERMS = ("compute", "tp", "bubble", "p2p", "dp", "optimizer")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def measured_terms(records: list[dict[str, Any]], predicted: dict[str, float]) -> dict[str, float]:
    """Per-term seconds of the steps ``records`` (see the module docstring), medians."""
    steps = [r["step_time_s"] for r in records]
    # the slowest rank waits least at each meeting: its blocked time is the communication
    # itself, the others' adds their wait for it
    exposed = [min(r.get("exposed_comm_s") or [0.0]) for r in records]
    optimizer = [r.get("optimizer_s") or 0.0 for r in records]
    bubble = [(r.get("pipeline") or {}).get("bubble_fraction", 0.0) * r["step_time_s"]
              for r in records]  # fmt: skip
    p2p_share = []
    for r in records:
        comm = r.get("comm") or {}
        total = sum(op.get("seconds", 0.0) for op in comm.values())
        p2p = sum(comm.get(op, {}).get("seconds", 0.0) for op in ("send", "recv"))
        p2p_share.append(p2p / total if total > 0 else 0.0)
    comm_s = _median(exposed)
    p2p_s = comm_s * _median(p2p_share)
    tp_pred, dp_pred = predicted.get("tp", 0.0), predicted.get("dp", 0.0)
    tp_share = tp_pred / (tp_pred + dp_pred) if tp_pred + dp_pred > 0 else 0.0
    terms = {
        "tp": (comm_s - p2p_s) * tp_share,
        "dp": (comm_s - p2p_s) * (1 - tp_share),
        "p2p": p2p_s,
        "bubble": _median(bubble),
        "optimizer": _median(optimizer),
    }
    terms["compute"] = max(0.0, _median(steps) - sum(terms.values()))
    return {k: terms[k] for k in TERMS}


def missed_most(predicted: dict[str, float], measured: dict[str, float]) -> str:
    """The term whose measured seconds are farthest from its prediction."""
    return max(TERMS, key=lambda k: abs(measured.get(k, 0.0) - predicted.get(k, 0.0)))


class PlanCheck:
    """Rank 0's comparison of an ``--auto`` run's steps with ``plan.json``."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.predicted_s = float(plan["predicted"]["step_time_s"])
        self.breakdown: dict[str, float] = dict(plan["predicted"]["breakdown_s"])
        self.records: list[dict[str, Any]] = []
        self.warned = False

    @classmethod
    def load(cls, run_root: Path) -> PlanCheck | None:
        """The run's check, or None when the run was not planned (no ``plan.json``)."""
        path = run_root / PLAN_NAME
        return cls(json.loads(path.read_text())) if path.is_file() else None

    def observe(self, record: dict[str, Any]) -> None:
        """Add the prediction to a step record; after the warm-up and ``CHECK_AFTER`` steps,
        warn once when the median step is more than ``TOLERANCE`` off."""
        record["predicted_step_time_s"] = self.predicted_s
        if record["step"] > WARMUP_STEPS:
            self.records.append(record)
        if len(self.records) == CHECK_AFTER:
            self.warn_if_off(self.records)

    def warn_if_off(self, records: list[dict[str, Any]]) -> None:
        if self.warned or not records:
            return
        self.warned = True
        step = _median([r["step_time_s"] for r in records])
        error = step / self.predicted_s - 1
        if abs(error) <= TOLERANCE:
            return
        terms = measured_terms(records, self.breakdown)
        term = missed_most(self.breakdown, terms)
        log.warning(
            "the measured step (%.3f s, median of steps %d-%d) is %+.0f%% off the predicted "
            "%.3f s; the term that missed most: %s (predicted %.3f s, measured about %.3f s)",
            step, records[0]["step"], records[-1]["step"], 100 * error, self.predicted_s,
            term, self.breakdown.get(term, 0.0), terms[term],
        )  # fmt: skip

    def summary(self, records: list[dict[str, Any]], peak_states: list[int]) -> dict[str, Any]:
        """``summary.json``'s ``plan``: the layout, predicted and measured step, terms, memory
        and communication, the error and the term that missed most."""
        after = [r for r in records if r.get("step", 0) > WARMUP_STEPS] or records[-1:]
        self.warn_if_off(after)  # a run shorter than the warm-up and the check
        step = _median([r["step_time_s"] for r in after])
        terms = measured_terms(after, self.breakdown) if after else {}
        bytes_per_step = [sum(op.get("bytes", 0) for op in (r.get("comm") or {}).values())
                          for r in after]  # fmt: skip
        predicted = self.plan["predicted"]
        return {
            "layout": self.plan["layout"]["describe"],
            "settings": self.plan["settings"],
            "predicted": predicted,
            "measured": {
                "step_time_s": step,
                "steps_compared": [r["step"] for r in after],
                "terms_s": terms,
                "memory_model_states_bytes_per_rank": peak_states,
                "comm_s_per_step": sum(terms.get(k, 0.0) for k in ("tp", "p2p", "dp")),
                "comm_bytes_per_step_rank0": _median([float(b) for b in bytes_per_step]),
            },
            "error": step / self.predicted_s - 1 if step else None,
            "missed_most": missed_most(self.breakdown, terms) if terms else None,
            "calibration_s": sum(self.plan["calibration"]["spent_s"].values()),
        }

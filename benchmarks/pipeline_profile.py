"""Where a pipeline step's time goes on one rank: named time splits, taken by wrapping the
methods that do each part (compute actions, message calls, collectives, the optimizer).

A wrapped call's own time excludes the wrapped calls made inside it (self time), so the splits
add up to at most the step; what is left is Python between the wrapped calls.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class Splits:
    """Seconds and calls per label since the last ``take``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.first: dict[str, float] = {}  # the first call's own seconds in this step
        self.cpu: dict[str, float] = defaultdict(float)  # this thread's CPU seconds, inclusive
        self._inner: list[float] = []  # time of wrapped calls inside each open call

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace ``owner.name`` (an attribute of an object or a module) with a timed call."""
        setattr(owner, name, self.timed(getattr(owner, name), label))

    def timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.cpu[label] += time.thread_time() - cpu0
                inner = self._inner.pop()
                self.seconds[label] += dt - inner
                self.first.setdefault(label, dt - inner)
                self.calls[label] += 1
                if self._inner:
                    self._inner[-1] += dt

        return call

    def take(self, step_s: float) -> dict[str, Any]:
        """This step's splits (``python`` = the step less every split) and reset."""
        out = {
            "seconds": dict(self.seconds),
            "calls": dict(self.calls),
            "first": dict(self.first),
            "cpu": dict(self.cpu),
        }
        out["seconds"]["python"] = step_s - sum(self.seconds.values())
        self.seconds.clear()
        self.cpu.clear()
        self.calls.clear()
        self.first.clear()
        return out


def mean_splits(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean seconds, calls, first call's seconds and CPU seconds per label over ``steps``
    (each from ``Splits.take``)."""
    labels = sorted({k for s in steps for k in s["seconds"]})
    n = max(len(steps), 1)
    return {
        "seconds": {k: sum(s["seconds"].get(k, 0.0) for s in steps) / n for k in labels},
        "calls": {k: sum(s["calls"].get(k, 0) for s in steps) / n for k in labels},
        "first": {k: sum(s["first"].get(k, 0.0) for s in steps) / n for k in labels},
        "cpu": {k: sum(s["cpu"].get(k, 0.0) for s in steps) / n for k in labels},
    }


def wrap_shardwise(splits: Splits, executor: Any) -> None:
    """Time a ``PipelineExecutor``'s parts: F and B compute (the last stage's F includes the
    loss), receives (posting and waiting), sends, freeing sent payloads, the end-of-step wait
    on sends and the loss broadcast."""
    splits.wrap(executor, "_forward", "F compute")
    splits.wrap(executor, "_backward_input", "B compute")
    ch = executor.channel
    for name in ("recv_activation", "recv_gradient"):
        splits.wrap(ch, name, "recv (post + wait)")
    for name in ("send_activation", "send_gradient"):
        splits.wrap(ch, name, "send (post)")
    for name in ("wait_recv", "post_recv"):
        if hasattr(ch, name):
            splits.wrap(ch, name, "recv (post + wait)")
    splits.wrap(ch, "release_completed", "release sent")
    splits.wrap(ch, "wait_all", "wait sends at end")
    splits.wrap(executor, "_mean_loss", "loss broadcast")


def wrap_torch(splits: Splits, schedule: Any, stage: Any) -> None:
    """Time a torch.distributed.pipelining schedule's parts: F and B compute, the loss, posting
    the batched sends/receives and waiting on them (receives and sends together, as torch
    waits on them together)."""
    from torch.distributed.pipelining import schedules

    splits.wrap(stage, "forward_one_chunk", "F compute")
    splits.wrap(stage, "backward_one_chunk", "B compute")
    splits.wrap(schedule, "_maybe_compute_loss", "loss")
    splits.wrap(schedules, "_batch_p2p", "p2p post")
    splits.wrap(schedules, "_wait_batch_p2p", "p2p wait (recv + send)")

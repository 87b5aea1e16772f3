"""Dropout randomness under tensor parallelism, on CPU and CUDA alike.

Two streams, as in Megatron-LM's RNG tracker, but counter-based instead of stateful:

- the *replicated* stream is torch's default generator, seeded identically on every tp rank of a
  model replica (``manual_seed``); dropout outside tp-sharded regions draws from it and so
  draws the same mask on every tp rank;
- the *sharded* stream is derived on demand: entering ``fork()`` draws one 62-bit counter from
  the replicated stream (the same draw on every tp rank) and seeds the generator with
  ``mix(counter, tp_rank)`` until the region ends, after which the replicated stream continues
  where the draw left it. Dropout inside a tp-sharded region (a sequence-parallel slice, local
  heads) so differs between tp ranks.

Everything sharded derives from the default generators' state, so activation-checkpoint
recompute, which restores that state at the start of its region, redraws the same counters and
replays every mask bit for bit; and saving ``rng_state()`` per rank saves both streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_MASK64 = (1 << 64) - 1
_MAX_SEED = 1 << 62


def mix(*values: int) -> int:
    """A 62-bit seed from integers (splitmix64 finaliser over each value in turn)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h % _MAX_SEED


def _cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def manual_seed(seed: int, *, pp_rank: int = 0, dp_rank: int = 0) -> None:
    """Seed the replicated stream: the same on every tp rank, distinct per (pp, dp) rank."""
    s = mix(seed, pp_rank, dp_rank)
    torch.default_generator.manual_seed(s)
    for d in _cuda_devices():
        torch.cuda.default_generators[d].manual_seed(s)


@contextmanager
def fork(tp_rank: int) -> Iterator[None]:
    """Run the body on this tp rank's sharded stream; restore the replicated stream after."""
    counter = int(torch.randint(0, _MAX_SEED, (1,)).item())  # the same on every tp rank
    seed = mix(counter, tp_rank)
    devices = _cuda_devices()
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for d in devices:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield


def rng_state() -> dict[str, Any]:
    """This rank's generator states (both streams derive from them); save them per rank."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = {d: torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state()`` returned on this rank."""
    if "cpu" not in state:
        raise ValueError("rng state has no 'cpu' entry; pass what rng_state() returned")
    torch.set_rng_state(state["cpu"])
    for d, s in state.get("cuda", {}).items():
        torch.cuda.set_rng_state(s, d)


class ForkOnForward:
    """Forward hooks that run a module on the sharded stream (a module may nest in another)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._open: list[Any] = []

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        ctx = fork(self.tp_rank)
        ctx.__enter__()
        self._open.append(ctx)

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

"""Rank functions for training under a per-process data limit: a model whose full fp32 weights
exceed the limit starts from a sharded Hugging Face directory at ZeRO-3 and trains, while the
same model built whole on the rank fails under it."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from big_load_cases import bound_holds

import shardwise

MiB = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def llama_config(layers: int, hidden: int):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def data_bytes() -> int:
    """This process's data segment now (``VmData``: private writable address space, which is
    what ``RLIMIT_DATA`` limits)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _exact_malloc() -> None:
    """Every allocation of 128 KiB or more its own mapping, returned when freed: glibc otherwise
    raises its threshold after the first frees and keeps freed tensors in its heap, so the data
    segment would measure the allocator's history rather than what is held."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


@contextmanager
def data_limit(extra: int) -> Iterator[int]:
    """Inside the block this process may hold at most ``extra`` bytes of data beyond what it
    holds on entry (the soft ``RLIMIT_DATA``; restored after). Yields the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_bytes() + extra
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.05)


def _config() -> shardwise.Config:
    return shardwise.Config(zero_stage=3, wrap_policy=["LlamaDecoderLayer"])


def _warm_up(config) -> None:  # type: ignore[no-untyped-def]
    """Start what any run starts once (threads, kernels, the allocator's arenas) on a small
    model, so the limit measures the run, not the interpreter's first steps."""
    from transformers import LlamaForCausalLM

    small = llama_config(1, 32)
    torch.manual_seed(0)
    engine = shardwise.initialize(LlamaForCausalLM(small), _sgd, _config())
    x = torch.randint(0, config.vocab_size, (1, 8))
    engine.backward(engine(x, labels=x).loss)
    engine.step()
    del engine


def train_under_limit(
    model_dir: str, layers: int, hidden: int, extra: int, steps: int
) -> tuple[list[float], int, int, int, str]:
    """Start ZeRO-3 from ``model_dir`` on a meta-built model and train ``steps`` steps with at
    most ``extra`` bytes of data beyond the warmed-up process; then try the full-model path
    (the model built whole on the rank, then loaded) under the same limit. Returns the losses,
    the most data held while training, the engine's init peak, its bound, and the full path's
    error."""
    from transformers import LlamaForCausalLM

    config = llama_config(layers, hidden)
    _exact_malloc()
    _warm_up(config)
    rank, size = shardwise.rank(), shardwise.world_size()
    x = torch.randint(0, config.vocab_size, (size, 8), generator=torch.Generator().manual_seed(3))
    mine = x[rank : rank + 1]
    losses: list[float] = []
    with data_limit(extra) as limit:
        start = data_bytes()
        with shardwise.deferred_init():
            meta = LlamaForCausalLM(config)
        engine = shardwise.initialize(meta, _sgd, _config(), weights=model_dir)
        most = data_bytes()
        for _ in range(steps):
            loss = engine(mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            most = max(most, data_bytes())
        peak, bound = bound_holds(engine)
        del engine, meta, loss
        full_error = _full_path_fails(config, model_dir)
    assert most <= limit
    return losses, most - start, peak, bound, full_error


def _full_path_fails(config, model_dir: str) -> str:  # type: ignore[no-untyped-def]
    """The model built whole on this rank, then loaded at ZeRO-3: the message of the error
    the limit causes (every rank builds, so every rank fails before any collective)."""
    from transformers import LlamaForCausalLM

    try:
        model = LlamaForCausalLM(config)
        shardwise.initialize(model, _sgd, _config(), weights=model_dir)
    except (MemoryError, RuntimeError) as exc:
        return str(exc).splitlines()[0]
    raise AssertionError("the full model fit under the limit: the limit is too high")

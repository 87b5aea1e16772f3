"""Text from a trained run: load its newest weights and sample a continuation of a prompt."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.data.corpus import Corpus
from shardwise.train.checkpoints import load_model
from shardwise.train.options import RunConfig
from shardwise.train.rundir import RunDir


@dataclass(frozen=True)
class Sample:
    """A prompt's continuation and where the weights came from."""

    prompt: str
    continuation: str
    step: int
    """Optimizer step of the weights."""
    source: str
    """The checkpoint root or model file they were read from."""


def sample(
    run_root: Path,
    prompt: str,
    *,
    tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> Sample:
    """Continue ``prompt`` by ``tokens`` bytes with the run's newest weights, on the CPU.

    ``temperature`` 0 picks the likeliest byte; ``top_k`` keeps only the k likeliest. Bytes
    that do not form valid UTF-8 show as U+FFFD.
    """
    if not prompt:
        raise ValueError("--prompt must not be empty: the model continues at least one byte")
    if tokens < 0:
        raise ValueError(f"--tokens must be >= 0, got {tokens}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {top_k}")
    run_dir = RunDir(run_root).require()
    run = RunConfig.read(run_dir.config)
    model, step, source = load_model(run.model, run_dir.final_model, run_dir.checkpoints)
    idx = Corpus.encode(prompt).unsqueeze(0)  # [1, prompt bytes]
    gen = torch.Generator().manual_seed(seed)
    out = model.generate(idx, tokens, temperature=temperature, top_k=top_k, generator=gen)
    return Sample(prompt, Corpus.decode(out[0, idx.shape[1] :]), step, source)

"""The peak per rank while a model is initialized or loaded: the final model states plus the
largest module held whole (deferred) or plus the whole model (eager)."""

from __future__ import annotations

import math

import pytest

from shardwise.cli.main import main as cli_main
from shardwise.costmodel import memory
from shardwise.estimate import estimate_init_peaks, estimate_model_states, format_bytes
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=50, seq_len=16, d_model=32, n_layer=2, n_head=4)


def _own_params(module) -> int:  # type: ignore[no-untyped-def]
    return sum(p.numel() for p in module._parameters.values() if p is not None)


def test_largest_unit_is_the_largest_module_of_the_built_gpt():
    model = GPT(CFG)
    assert memory.gpt_largest_unit_elements(CFG) == max(map(_own_params, model.modules()))
    assert memory.gpt_largest_unit_elements(CFG) == 4 * 32 * 32 + 4 * 32  # the MLP's fc_in
    # tp=2: fc_in's weight and bias split; the vocabulary (25 rows of 32) is smaller
    assert memory.gpt_largest_unit_elements(CFG, 2) == (4 * 32 * 32 + 4 * 32) // 2
    wide = GPTConfig(vocab_size=1000, seq_len=16, d_model=32, n_layer=2, n_head=4)
    assert memory.gpt_largest_unit_elements(wide, 2) == 500 * 32  # the embedding's tp rows


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_init_peak_figures(stage):
    n = CFG.param_count()
    states = memory.model_states(n, 2, stage)
    got = memory.init_peak(states, 4224, n)
    shard = math.ceil(n / 2)
    final = {0: 16 * n, 1: 8 * n + 8 * shard, 2: 4 * n + 12 * shard, 3: 16 * shard}[stage]
    assert got.deferred_bytes == final + 4 * 4224
    assert got.eager_bytes == final + 4 * n
    assert estimate_init_peaks(estimate_model_states(n, 2), 4224, n)[stage] == got


def test_init_peak_refuses_negative_counts():
    states = memory.model_states(10, 2, 3)
    with pytest.raises(ValueError, match="largest_unit_elements=-1"):
        memory.init_peak(states, -1, 10)


def test_estimate_prints_both_init_peaks(capsys):
    assert cli_main(["estimate", "--model", "small", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    cfg = GPTConfig.named("small")
    n = cfg.param_count()
    peak = memory.init_peak(memory.model_states(n, 2, 3), memory.gpt_largest_unit_elements(cfg), n)
    lines = out.splitlines()
    table = lines[next(i for i, x in enumerate(lines) if "initialized or loaded" in x) :]
    assert table[1].split() == ["stage", "deferred", "init/load", "eager", "init"]
    row = table[5]  # stage 3
    assert format_bytes(peak.deferred_bytes) in row and format_bytes(peak.eager_bytes) in row
    assert cli_main(["estimate", "--params", "7e9", "--world-size", "64"]) == 0
    assert "+ largest module" in capsys.readouterr().out  # unknown without a model

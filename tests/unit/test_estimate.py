"""Memory estimator: ZeRO model-state formulas, activation count vs. what autograd saves."""

from __future__ import annotations

import argparse
from fractions import Fraction

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.cli import estimate_cmd
from shardwise.cli.estimate_cmd import run_estimate
from shardwise.cli.main import main as cli_main
from shardwise.costmodel import pipeline_memory as ppe
from shardwise.costmodel import tp_memory as tpe
from shardwise.estimate import (
    StageEstimate,
    estimate_activations,
    estimate_model_states,
    fits,
    format_estimate_table,
    parse_bytes,
)
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.pipeline.simulate import simulate
from shardwise.testing import SavedTensorBytes

# (params, grads, optimizer) bytes per element and which of them a stage shards.
_PER_ELEMENT = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
_SHARDED = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 1), 3: (1, 1, 1)}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("num_params", "world_size"), [(1000, 1), (1200, 4), (23_240_704, 8)])
def test_model_state_formulas(precision: str, num_params: int, world_size: int) -> None:
    est = estimate_model_states(num_params, world_size, precision, reduce_dtype=precision)
    assert sorted(est) == [0, 1, 2, 3]
    k = _PER_ELEMENT[precision]
    for stage, sharded in _SHARDED.items():
        want = [k[i] * num_params // (world_size if sharded[i] else 1) for i in range(3)]
        e = est[stage]
        assert [e.params_bytes, e.grads_bytes, e.optimizer_bytes] == want
        assert e.device_bytes == e.total_bytes == sum(want)
        assert e.host_bytes == 0


def test_model_state_totals_per_paper() -> None:
    psi, n = 7_500_000_000, 64  # the ZeRO paper's 7.5B model on 64 GPUs, mixed precision
    est = estimate_model_states(psi, n, "fp16", reduce_dtype="fp16")
    assert est[0].total_bytes == 16 * psi  # 120 GB
    assert est[1].total_bytes == 4 * psi + 12 * psi // n  # 31.4 GB
    assert est[2].total_bytes == 2 * psi + 14 * psi // n  # 16.6 GB
    assert est[3].total_bytes == 16 * psi // n  # 1.9 GB


def test_padding_rounds_shards_up() -> None:
    est = estimate_model_states(10, 3, "fp32")  # 10 params pad to 12: 4 per rank
    assert est[1].optimizer_bytes == 8 * 4
    assert est[2].grads_bytes == 4 * 4
    assert est[3].params_bytes == 4 * 4
    assert est[0].params_bytes == 4 * 10  # unsharded parts are not padded


def test_offload_moves_optimizer_to_host() -> None:
    on = estimate_model_states(1200, 4, "bf16", offload=False, reduce_dtype="bf16")
    off = estimate_model_states(1200, 4, "bf16", offload=True, reduce_dtype="bf16")
    for stage in range(4):
        assert off[stage].host_bytes == on[stage].optimizer_bytes
        assert off[stage].device_bytes == on[stage].params_bytes + on[stage].grads_bytes
        assert off[stage].total_bytes == on[stage].total_bytes
    assert off[0].host_bytes == 12 * 1200


def test_fits_and_table() -> None:
    est = estimate_model_states(1_000_000, 2, "fp32")
    assert fits(est[0], 16_000_000)
    assert not fits(est[0], 15_999_999)
    assert fits(est[3], 8_000_000)
    assert not fits(est[3], 8_000_000, activation_bytes=1)
    table = format_estimate_table(est, device_memory_bytes=10_000_000)
    lines = table.splitlines()
    assert len(lines) == 5
    assert "params" in lines[0] and "fits" in lines[0]
    assert lines[1].strip().startswith("0") and lines[1].rstrip().endswith("no")
    assert lines[4].rstrip().endswith("yes")
    offloaded = format_estimate_table(estimate_model_states(1000, 2, offload=True))
    assert "host" in offloaded


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 MiB") == 3 * 2**19
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("4KiB") == 4096
    assert parse_bytes("3kb") == 3000
    assert parse_bytes("17B") == 17
    assert parse_bytes("42") == 42
    assert parse_bytes(7) == 7
    for bad in ("", "GB", "-1GB", "10 parsecs", "1.2.3MB"):
        with pytest.raises(ValueError, match="GiB"):
            parse_bytes(bad)


def test_bad_inputs_name_allowed_values() -> None:
    with pytest.raises(ValueError, match="world_size"):
        estimate_model_states(100, 0)
    with pytest.raises(ValueError, match="num_params"):
        estimate_model_states(-1, 2)
    with pytest.raises(ValueError, match="bf16"):
        estimate_model_states(100, 2, "fp8")
    cfg = GPTConfig.named("tiny")
    with pytest.raises(ValueError, match="fp32"):
        estimate_activations(cfg, 1, 8, "int8", False)
    with pytest.raises(ValueError, match="micro_batch"):
        estimate_activations(cfg, 0, 8, "fp32", False)
    with pytest.raises(ValueError, match="seq_len"):
        estimate_activations(cfg, 1, 65, "fp32", False)


class _Checkpointed(nn.Module):
    """Runs a block under non-reentrant checkpointing, remembering its input."""

    def __init__(self, block: nn.Module, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.inputs = inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return checkpoint(self.block, x, use_reentrant=False)


def _measure(cfg: GPTConfig, batch: int, seq: int, dtype: torch.dtype, ckpt: bool) -> int:
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    targets = torch.randint(0, cfg.vocab_size, (batch, seq))
    saved = SavedTensorBytes(model)
    if not ckpt:
        saved.measure(lambda: model(idx, targets))
        return saved.total
    inputs: list[torch.Tensor] = []
    blocks = list(model.blocks)
    model.blocks = nn.ModuleList(_Checkpointed(b, inputs) for b in blocks)
    saved.measure(lambda: model(idx, targets))
    # Checkpoint recomputes under its own hooks, out of sight: measure each block's recompute
    # as a plain forward on its saved input and keep the largest, as backward holds one at a time.
    forward_bytes = saved.total
    recompute = 0
    for block, x in zip(blocks, inputs, strict=True):
        one = SavedTensorBytes(model, already=saved)  # the block input is already counted
        one.measure(lambda block=block, x=x: block(x.detach().requires_grad_()))
        recompute = max(recompute, one.total - forward_bytes)
    return forward_bytes + recompute


@pytest.mark.parametrize("ckpt", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize(
    ("dtype", "precision", "dropout"),
    [(torch.float32, "fp32", 0.0), (torch.float32, "fp32", 0.1), (torch.bfloat16, "bf16", 0.0)],
    ids=["fp32", "fp32-dropout", "bf16"],
)
def test_activation_estimate_matches_saved_tensors(
    dtype: torch.dtype, precision: str, dropout: float, ckpt: bool
) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, seq_len=48, n_layer=3, n_head=4, d_model=64, dropout=dropout)
    batch, seq = 2, 40
    measured = _measure(cfg, batch, seq, dtype, ckpt)
    estimated = estimate_activations(cfg, batch, seq, precision, ckpt)
    assert estimated == pytest.approx(measured, rel=0.15)
    if dtype == torch.float32:
        # fp32 on CPU saves exactly what the count describes (up to the loss's scalar weight).
        assert abs(estimated - measured) <= 8


def test_checkpointing_saves_memory_and_scales() -> None:
    cfg = GPTConfig.named("anchor")
    full = estimate_activations(cfg, 8, 256, "bf16", checkpointing=False)
    ckpt = estimate_activations(cfg, 8, 256, "bf16", checkpointing=True)
    assert ckpt < full / 2
    # everything but the int64 position ids (one per position) grows with the batch
    assert estimate_activations(cfg, 16, 256, "bf16", False) == 2 * full - 256 * 8
    assert estimate_activations(cfg, 8, 256, "fp32", False) > full


def test_stage_estimate_is_plain_data() -> None:
    e = StageEstimate(stage=2, params_bytes=1, grads_bytes=2, optimizer_bytes=3, offload=True)
    assert (e.device_bytes, e.host_bytes, e.total_bytes) == (3, 3, 6)


def test_fp32_reduction_keeps_fp32_gradient_shards() -> None:
    """The engine's default reduce dtype is fp32: sharded gradients take 4 bytes each."""
    paper = estimate_model_states(1200, 4, "bf16", reduce_dtype="bf16")
    default = estimate_model_states(1200, 4, "bf16")
    for stage in (0, 1):
        assert default[stage].grads_bytes == paper[stage].grads_bytes == 2 * 1200
    for stage in (2, 3):
        assert default[stage].grads_bytes == 2 * paper[stage].grads_bytes == 4 * 300


# ---- pipeline parallelism (``shardwise estimate --pp``) -------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_pipeline_params_per_rank_count_the_gpts_modules(pp: int) -> None:
    cfg = GPTConfig(vocab_size=37, seq_len=8, n_layer=5, n_head=4, d_model=16)
    model = GPT(cfg)

    def count(*modules: nn.Module) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    blocks = ppe.blocks_per_rank(cfg.n_layer, pp)
    assert blocks == {1: [5], 2: [3, 2], 3: [2, 2, 1]}[pp]
    starts = [sum(blocks[:r]) for r in range(pp)]
    want = [count(*model.blocks[s : s + n]) for s, n in zip(starts, blocks)]
    want[0] += count(model.tok_emb, model.pos_emb)
    want[-1] += count(model.ln_f) + (count(model.tok_emb) if pp > 1 else 0)  # the tied copy
    assert ppe.gpt_params_per_pp_rank(cfg, pp) == want
    # under tp each rank holds its tp share: the same sum as tp.estimate's, plus the tied copy
    for tp in (2, 4):
        sharded, replicated = tpe.gpt_params_per_rank(cfg, tp)
        copy = (19 if tp == 2 else 10) * 16 if pp > 1 else 0  # ceil(37 / tp) rows of 16
        assert sum(ppe.gpt_params_per_pp_rank(cfg, pp, tp)) == sharded + replicated + copy


def test_pipeline_in_flight_per_schedule() -> None:
    for p, m in ((4, 2), (4, 8), (3, 5)):
        assert ppe.peak_in_flight("gpipe", p, m) == [m] * p
        assert ppe.peak_in_flight("1f1b", p, m) == [min(p - r, m) for r in range(p)]
    for name, v in (("interleaved_1f1b", 2), ("zb_h1", 1)):
        sim = simulate(name, 4, 8, virtual_stages=v)
        want = [Fraction(sim.peak_inflight[r], v) for r in range(4)]
        assert ppe.peak_in_flight(name, 4, 8, v) == want
    # interleaved (Megatron-LM's warm-up): rank r runs (v - 1) * p + 2 * (p - 1 - r) forward
    # chunks before its first backward, holding one more: at p = v = 2, rank 0 holds 5 chunks
    assert ppe.peak_in_flight("interleaved_1f1b", 2, 4, 2)[0] == Fraction(5, 2)


def test_pipeline_activation_bytes_from_the_formulas() -> None:
    cfg = GPTConfig(vocab_size=37, seq_len=8, n_layer=4, n_head=2, d_model=16)
    s, b, h, a = 8, 2, 16, 2
    per_layer = s * b * h * (34 + 5 * a * s // h)  # 256 * 39 = 9984 bytes, no parallelism
    assert per_layer == 9984
    got = ppe.gpt_pipeline_estimate(cfg, 2, "1f1b", 4, b, s)
    assert [r.blocks for r in got] == [2, 2] and [r.in_flight for r in got] == [2, 1]
    assert [r.activation_bytes["none"] for r in got] == [2 * 2 * 9984, 1 * 2 * 9984]
    assert [r.activation_bytes["full"] for r in got] == [2 * 2 * 2 * s * b * h, 2 * 2 * s * b * h]
    gpipe = ppe.gpt_pipeline_estimate(cfg, 2, "gpipe", 4, b, s, tp=2, sequence_parallel=True)
    sp_layer = s * b * h * (34 + 5 * a * s // h) // 2  # Korthikanti, tp + SP: all of it / t
    assert [r.activation_bytes["none"] for r in gpipe] == [4 * 2 * sp_layer] * 2
    assert [r.params for r in gpipe] == ppe.gpt_params_per_pp_rank(cfg, 2, 2)
    chunked = ppe.gpt_pipeline_estimate(cfg, 2, "interleaved_1f1b", 4, b, s, virtual_stages=2)
    for r, one in enumerate(chunked):  # a chunk holds one of the rank's two blocks
        flight = ppe.peak_in_flight("interleaved_1f1b", 2, 4, 2)[r]
        assert one.activation_bytes["selective"] == flight * 2 * s * b * h * 34


def test_pipeline_estimate_refusals() -> None:
    cfg = GPTConfig(vocab_size=37, seq_len=8, n_layer=4, n_head=2, d_model=16)
    with pytest.raises(ValueError, match="n_layer=4"):
        ppe.blocks_per_rank(4, 5)
    with pytest.raises(ValueError, match="virtual_stages=3"):
        ppe.gpt_pipeline_estimate(cfg, 2, "interleaved_1f1b", 4, 1, 8, virtual_stages=3)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        ppe.gpt_pipeline_estimate(cfg, 2, "1f1b", 4, 1, 8, virtual_stages=2)


def _estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli_main(["estimate", *argv]) == 0
    return capsys.readouterr().out


def test_estimate_cli_with_pp(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = GPTConfig.named("small")
    out = _estimate(capsys, "--model", "small", "--world-size", "8", "--pp", "2", "--tp", "2")
    assert "8 ranks = dp 2 x tp 2 x pp 2" in out and "pipeline 1f1b, 2 micro-batches" in out
    # --micro-batch 16 (the default) splits into 2 pipeline micro-batches of 8, as in train
    ranks = ppe.gpt_pipeline_estimate(cfg, 2, "1f1b", 2, 8, cfg.seq_len, tp=2)
    for r in ranks:
        assert f"{r.params:,}" in out
    states = [estimate_model_states(r.params, 2)[0].device_bytes for r in ranks]
    peak = max(st + r.activation_bytes["none"] for st, r in zip(states, ranks))
    assert f"{peak / 2**20:.2f} MiB" in out
    for argv, match in (
        (["--microbatches", "4"], "--microbatches describes a pipeline"),
        (
            ["--pp", "3", "--world-size", "4"],
            "--pp 3 does not divide --world-size 4: use --world-size 3 or 6",
        ),
        (["--pp", "2", "--world-size", "2", "--microbatches", "0"], "--microbatches must be"),
    ):
        with pytest.raises(ValueError, match=match):
            run_estimate(_args(["--model", "small", *argv]))


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    estimate_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["estimate", *argv])

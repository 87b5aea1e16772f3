"""Deferred initialization and streaming loads (#19): a model built on the meta device starts
at every rank from its own pieces, equal to an eager build or to the checkpoint it was read
from, within the memory bound, and bad sources fail on every rank naming the file and tensor."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import big_load_cases as bc
import pytest
import torch

from shardwise.costmodel import memory
from shardwise.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import hf_models  # noqa: E402


@pytest.mark.parametrize("world", [2, 3])
def test_gpt_built_on_meta_equals_eager_bitwise_at_zero3(world):
    for peak, bound in run_on_ranks(world, bc.gpt_deferred_equals_eager, 3, timeout_s=300):
        assert 0 < peak <= bound


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("tie", [False, True])
def test_hf_llama_built_on_meta_equals_eager_bitwise_at_zero3(world, tie):
    pytest.importorskip("transformers")
    for peak, bound in run_on_ranks(world, bc.llama_deferred_equals_eager, tie, timeout_s=300):
        assert 0 < peak <= bound


@pytest.mark.parametrize("stage", [3, 1])
def test_measured_init_peaks_within_the_costmodel_figures(stage):
    cfg, n = bc.GPT_CFG, bc.GPT_CFG.param_count()
    unit = memory.gpt_largest_unit_elements(cfg)
    predicted = memory.init_peak(memory.model_states(n, 2, stage), unit, n)
    for got in run_on_ranks(2, bc.init_peak_against_costmodel, stage, timeout_s=300):
        assert got["transient"] == 4 * unit  # the largest module's fp32 scratch, held whole
        assert 0 < got["deferred"] <= predicted.deferred_bytes
        assert 0 < got["eager"] <= predicted.eager_bytes
        # the paths differ by exactly what the model says: the whole model less one module
        assert got["eager"] - got["deferred"] == predicted.eager_bytes - predicted.deferred_bytes


PAGE_SLACK = 4096 + 128  # a tensor of 128 KiB or more is its own mapping: page, header, alignment


@pytest.mark.long
@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_ranks_never_allocate_another_stage(pp):
    # the GPT recipe from a meta-built GPT (the README's and `train --pp`'s path): no rank ever
    # holds more than its own stage plus the largest module (the one being initialized), and
    # its weights equal the eagerly built GPT's (checked on the rank)
    for r in run_on_ranks(pp, bc.pipeline_stage_allocation, pp, True, timeout_s=300):
        # its stage's tensors and the scratch module's (weight and bias), each page-rounded,
        # and 128 KiB of small things (a 64 Ki-element check mask, the tied group's objects)
        slack = PAGE_SLACK * (r["params"] + 2) + 128 * 1024
        assert r["own"] < r["held"] <= r["own"] + r["largest"] + slack, r
        assert r["own"] + r["largest"] + slack < r["whole"]  # the figure tells the paths apart


@pytest.mark.long
def test_eager_pipeline_build_holds_the_whole_model_first():
    # the measure above, on the eager path: every rank held the whole GPT while it was split
    for r in run_on_ranks(2, bc.pipeline_stage_allocation, 2, False, timeout_s=300):
        assert r["held"] >= r["whole"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    return hf_models.save(hf_models.tiny_llama(seed=0), path, max_shard_size="20KB")


@pytest.mark.parametrize("stage", [3, 1])
def test_llama_dir_loads_at_dp2_and_trains_like_one_process(llama_dir, stage):
    assert (llama_dir / "model.safetensors.index.json").is_file()  # sharded
    rows = run_on_ranks(2, bc.llama_load_train, str(llama_dir), stage, timeout_s=300)
    for step in range(3):
        mean = sum(r[0][step][0] for r in rows) / 2
        assert mean == pytest.approx(rows[0][0][step][1], rel=1e-5)
    for _, (peak, bound) in rows:
        assert 0 < peak <= bound


def _copy(llama_dir: Path, bad: Path) -> Path:
    bad.mkdir()
    for f in llama_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    return bad


def test_index_naming_a_missing_file_fails_on_every_rank(llama_dir, tmp_path):
    bad = _copy(llama_dir, tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[0]
    (bad / gone).unlink()
    messages = run_on_ranks(2, bc.bad_source, str(bad), timeout_s=300)
    assert all(gone in m for m in messages)


def test_truncated_file_fails_on_every_rank(llama_dir, tmp_path):
    bad = _copy(llama_dir, tmp_path / "trunc")
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    messages = run_on_ranks(2, bc.bad_source, str(bad), timeout_s=300)
    assert all(shard.name in m for m in messages)


TENSOR = "model.layers.1.mlp.up_proj.weight"  # [64, 32] fp32 in one of the shards


def _holder(bad: Path) -> Path:
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    return bad / index["weight_map"][TENSOR]


def _replace_tensor(bad: Path, value: torch.Tensor) -> Path:
    """Rewrite the shard holding ``TENSOR`` with ``value`` in its place; the shard."""
    from safetensors.torch import load_file, save_file

    shard = _holder(bad)
    tensors = load_file(shard)
    tensors[TENSOR] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _unreadable_dtype(bad: Path) -> Path:
    """``TENSOR``'s header entry given a dtype the loader cannot read (complex), bytes kept."""
    shard = _holder(bad)
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[TENSOR]["dtype"] = "C64"  # 8 bytes an element: data_offsets would not match F32
    header[TENSOR]["shape"] = [32, 32]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    shard.write_bytes(bytes(raw[:8]) + text + bytes(raw[8 + n :]))
    return shard


@pytest.mark.parametrize(
    "fault,problem",
    [
        ("shape", "model has [64, 32]"),
        ("int64", "torch.int64, model has [64, 32] torch.float32"),
        ("bool", "torch.bool, model has [64, 32] torch.float32"),
        ("unreadable", "dtype 'C64' cannot be read"),
    ],
)
@pytest.mark.parametrize("layout", ["dp2_zero3", "pp2"])
def test_tensor_with_wrong_shape_or_dtype_fails_on_every_rank(
    llama_dir, tmp_path, fault, problem, layout
):
    # at pp2 the tensor is on the second stage only: the first learns of it from there
    bad = _copy(llama_dir, tmp_path / fault)
    if fault == "shape":
        shard = _replace_tensor(bad, torch.zeros(64, 31))
    elif fault in ("int64", "bool"):
        shard = _replace_tensor(bad, torch.zeros(64, 32, dtype=getattr(torch, fault)))
    else:
        shard = _unreadable_dtype(bad)
    messages = run_on_ranks(2, bc.bad_source, str(bad), layout, timeout_s=120)
    assert len(messages) == 2
    for m in messages:
        assert shard.name in m and repr(TENSOR) in m and problem in m, m


@pytest.mark.parametrize("escape", ["parent", "absolute", "subdir"])
def test_index_names_escaping_the_directory_fail_on_every_rank(llama_dir, tmp_path, escape):
    bad = _copy(llama_dir, tmp_path / escape)
    shard = _holder(bad)
    outside = tmp_path / shard.name
    outside.write_bytes(shard.read_bytes())  # the escaping name points at a real file
    (bad / "sub").mkdir()
    (bad / "sub" / shard.name).write_bytes(shard.read_bytes())
    named = {"parent": f"../{shard.name}", "absolute": str(outside), "subdir": f"sub/{shard.name}"}
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][TENSOR] = named[escape]
    index_path.write_text(json.dumps(index))
    messages = run_on_ranks(2, bc.bad_source, str(bad), timeout_s=300)
    assert len(messages) == 2
    for m in messages:
        assert index_path.name in m and repr(TENSOR) in m and "not a plain file name" in m, m


def test_meta_parameter_nobody_initialized_is_named_on_every_rank():
    messages = run_on_ranks(2, bc.uninitialized_meta_param, timeout_s=300)
    assert all("'scale'" in m for m in messages)

"""Reading a rank's share of Hugging Face safetensors weights: boxes, flat ranges, bad files."""

from __future__ import annotations

import itertools
import json
import math
import os
import struct

import hf_models as hm
import pytest
import torch
from safetensors.torch import save_file

from shardwise import comm
from shardwise.hf import WeightsError, open_weights
from shardwise.hf.model_dir import SAFE_WEIGHTS_INDEX_NAME

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    return hm.tiny_llama()


@pytest.fixture(scope="module")
def sharded_dir(llama, tmp_path_factory):
    return hm.save(llama, tmp_path_factory.mktemp("sharded"), "20KB")


def _tp_boxes(shape: tuple[int, ...], dim: int, tp: int) -> list[tuple[tuple[int, ...], ...]]:
    """The (offsets, shape) of each tp rank's slice of ``shape`` split on ``dim`` (uneven ok)."""
    out = []
    for r in range(tp):
        lo, hi = shape[dim] * r // tp, shape[dim] * (r + 1) // tp
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        size = tuple(hi - lo if d == dim else s for d, s in enumerate(shape))
        out.append((offsets, size))
    return out


@pytest.mark.parametrize("max_shard_size", ["20KB", "50GB"])
def test_boxes_equal_the_model_tensors_bitwise(llama, tmp_path, max_shard_size):
    path = hm.save(llama, tmp_path, max_shard_size)
    n_files = len(list(tmp_path.glob("*.safetensors")))
    assert (n_files > 1) == (max_shard_size == "20KB")
    state = llama.state_dict()
    with open_weights(path) as source:
        assert source.names() == sorted(state)
        for name, full in state.items():
            assert source.shape(name) == tuple(full.shape)
            assert source.dtype(name) == torch.float32
            for dim in range(full.dim()):
                for offsets, size in _tp_boxes(tuple(full.shape), dim, 3):
                    box = source.read_box(name, offsets, size)
                    index = tuple(slice(o, o + s) for o, s in zip(offsets, size))
                    assert torch.equal(box, full[index]), (name, dim, offsets)


def test_bf16_on_disk_reads_into_fp32_per_slice(tmp_path):
    model = hm.tiny_llama().to(torch.bfloat16)
    hm.save(model, tmp_path, "20KB")
    state = model.state_dict()
    with open_weights(tmp_path) as source:
        for name, full in state.items():
            assert source.dtype(name) == torch.bfloat16
            rows = full.shape[0] // 2
            box = source.read_box(name, (rows,) + (0,) * (full.dim() - 1), full[rows:].shape)
            assert box.dtype == torch.bfloat16
            fp32 = source.read_flat(name, 3, full.numel() - 5, torch.float32)
            assert fp32.dtype == torch.float32
            assert torch.equal(fp32, full.reshape(-1)[3:-5].float())


def test_a_rank_reads_its_share_not_the_file(llama, sharded_dir):
    embed = llama.state_dict()["model.embed_tokens.weight"]  # [96, 32] fp32
    file_bytes = sum(p.stat().st_size for p in sharded_dir.glob("*.safetensors"))
    for dim in (0, 1):
        with open_weights(sharded_dir) as source:
            offsets, size = _tp_boxes(tuple(embed.shape), dim, 4)[1]
            source.read_box("model.embed_tokens.weight", offsets, size, torch.float32)
            assert source.bytes_read == math.prod(size) * 4 == embed.numel() * 4 // 4
            assert source.bytes_read * 4 < file_bytes / 5


def test_flat_ranges_may_start_and_end_inside_rows(llama, sharded_dir):
    state = llama.state_dict()
    with open_weights(sharded_dir) as source:
        for name, full in state.items():
            numel = full.numel()
            bounds = [0, numel // 3 + 1, 2 * numel // 3 - 1, numel]  # 3 uneven ZeRO shards
            before = source.bytes_read
            parts = [source.read_flat(name, lo, hi) for lo, hi in itertools.pairwise(bounds)]
            assert torch.equal(torch.cat(parts), full.reshape(-1)), name
            assert source.bytes_read - before == numel * 4  # exactly the ranges, no extra rows
        assert source.read_flat("model.norm.weight", 5, 5).numel() == 0


def test_open_files_stay_bounded(sharded_dir):
    with open_weights(sharded_dir, max_open_files=2) as source:
        files = {source.info(n).file for n in source.names()}
        assert len(files) > 2
        for name in source.names():
            source.read_full(name)
            assert source.open_file_count <= 2


def test_a_plain_safetensors_file(tmp_path):
    tensors = {"a": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    save_file(tensors, tmp_path / "w.safetensors")
    with open_weights(tmp_path / "w.safetensors") as source:
        assert source.names() == ["a", "step"]
        assert torch.equal(source.read_box("a", (1, 1), (2, 2)), tensors["a"][1:, 1:3])
        assert source.read_full("step").item() == 7


def _one_line(exc: pytest.ExceptionInfo[WeightsError]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def _rewrite_index(root, edit) -> None:
    index = json.loads((root / SAFE_WEIGHTS_INDEX_NAME).read_text())
    edit(index["weight_map"])
    (root / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index))


def test_a_missing_shard_is_named_with_a_tensor(llama, tmp_path):
    hm.save(llama, tmp_path, "20KB")
    victim = "model-00003-of-00007.safetensors"
    (tmp_path / victim).unlink()
    with pytest.raises(WeightsError) as exc:
        open_weights(tmp_path)
    msg = _one_line(exc)
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"]
    assert victim in msg and exc.value.tensor in index and index[exc.value.tensor] == victim


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/x.safetensors", "sub/x.safetensors"])
def test_index_names_escaping_the_directory_are_refused(llama, tmp_path, bad):
    root = tmp_path / "m"
    hm.save(llama, root, "20KB")
    (tmp_path / "x.safetensors").write_bytes(
        (root / "model-00001-of-00007.safetensors").read_bytes()
    )
    _rewrite_index(root, lambda wm: wm.update({"model.norm.weight": bad}))
    with pytest.raises(WeightsError) as exc:
        open_weights(root)
    msg = _one_line(exc)
    assert bad in msg and "'model.norm.weight'" in msg and SAFE_WEIGHTS_INDEX_NAME in msg


@pytest.mark.parametrize("max_shard_size", ["20KB", "50GB"])
def test_a_truncated_file_names_the_file_and_the_cut_tensor(llama, tmp_path, max_shard_size):
    hm.save(llama, tmp_path, max_shard_size)
    victim = sorted(tmp_path.glob("*.safetensors"))[-1]
    os.truncate(victim, victim.stat().st_size - 3)
    with pytest.raises(WeightsError) as exc:
        open_weights(tmp_path)
    msg = _one_line(exc)
    assert str(victim) in msg and "truncated" in msg
    assert exc.value.path == victim and exc.value.tensor in llama.state_dict()


def test_a_garbage_header_length_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(WeightsError, match="header length"):
        open_weights(tmp_path)


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"b": torch.zeros(2)}, tmp_path / "two.safetensors")
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (tmp_path / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightsError) as exc:
        open_weights(tmp_path)
    msg = _one_line(exc)
    assert "'b'" in msg and "one.safetensors" in msg and "two.safetensors" in msg


def test_an_index_entry_the_file_lacks_is_refused(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"b": torch.zeros(2)}, tmp_path / "two.safetensors")
    index = {"weight_map": {"a": "one.safetensors", "b": "one.safetensors"}}
    (tmp_path / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightsError) as exc:
        open_weights(tmp_path)
    assert exc.value.tensor == "b" and "one.safetensors" in _one_line(exc)


def test_reads_outside_the_tensor_or_across_dtype_kinds_are_refused(tmp_path):
    save_file({"ids": torch.arange(6), "w": torch.ones(2, 3)}, tmp_path / "w.safetensors")
    with open_weights(tmp_path / "w.safetensors") as source:
        with pytest.raises(WeightsError, match=r"'ids'.*cannot be read as torch.float32"):
            source.read_flat("ids", 0, 6, torch.float32)
        with pytest.raises(WeightsError, match=r"'w'.*must lie within"):
            source.read_box("w", (1, 0), (2, 3))
        with pytest.raises(WeightsError, match=r"'w'.*flat range"):
            source.read_flat("w", 4, 7)
        assert source.bytes_read == 0


def test_a_shardwise_checkpoint_reads_like_a_hugging_face_directory(llama, tmp_path):
    import shardwise
    from shardwise.checkpoint import ShardEntry, entries_of_flat_range, save_checkpoint
    from shardwise.hf import CheckpointWeights, map_names, model_spec

    state = llama.state_dict()
    entries = []
    for i, (name, full) in enumerate(state.items()):  # bf16 on disk, half row-split, half flat
        full = full.to(torch.bfloat16)
        if i % 2:
            entries.append(ShardEntry(f"model/{name}", tuple(full.shape), (0,) * full.dim(), full))
        else:
            cut = full.numel() // 3 + 1
            for lo, hi in [(0, cut), (cut, full.numel())]:
                entries += entries_of_flat_range(
                    f"model/{name}", tuple(full.shape), lo, full.reshape(-1)[lo:hi]
                )
    shardwise.init(backend="gloo")
    try:
        save_checkpoint(tmp_path, 1, entries, {}, None, group=comm.world())
    finally:
        shardwise.shutdown()
    with CheckpointWeights(tmp_path) as source:
        mapping = map_names(model_spec(llama), source)
        assert mapping.complete
        embed = state["model.embed_tokens.weight"].to(torch.bfloat16).float()
        box = source.read_box("model.embed_tokens.weight", (0, 8), (96, 8), torch.float32)
        assert torch.equal(box, embed[:, 8:16]) and source.bytes_read == 96 * 8 * 2
        flat = source.read_flat("model.embed_tokens.weight", 45, 1000, torch.float32)
        assert torch.equal(flat, embed.reshape(-1)[45:1000])
        with pytest.raises(WeightsError, match=r"cannot be read as torch.int64"):
            source.read_flat("model.norm.weight", 0, 4, torch.int64)

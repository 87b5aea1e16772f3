"""Checkpoint storage in one process (a world of one): format, journal, damage, tools."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise import comm
from shardwise.checkpoint import (
    AsyncCheckpointWriter,
    CheckpointError,
    CheckpointReader,
    ShardEntry,
    delete_checkpoint,
    entries_of_flat_range,
    export_consolidated,
    find_latest_valid,
    inspect,
    resolve,
    save_checkpoint,
    verify,
    verify_cli,
)
from shardwise.checkpoint.journal import Journal, encode_record
from shardwise.checkpoint.layout import JOURNAL_NAME, MANIFEST_NAME, step_dir_name, tmp_dir_name

SHARD = "shard-00000-of-00001.safetensors"
RANK_FILE = "rank-00000.safetensors"


@pytest.fixture(scope="module", autouse=True)
def world() -> Iterator[None]:
    shardwise.init(backend="gloo")
    yield
    shardwise.shutdown()  # the next init forms a fresh world, with fresh groups


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/embed.weight": torch.randn(5, 4, generator=g),
        "model/head.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "optim/embed.weight/exp_avg": torch.randn(5, 4, generator=g),
        "optim/step": torch.tensor([seed], dtype=torch.int64),
    }


def _entries(full: dict[str, torch.Tensor], cuts: int = 3) -> list[ShardEntry]:
    """Every tensor split into up to ``cuts`` uneven pieces, all held by this rank."""
    out = []
    for name, t in full.items():
        flat = t.reshape(-1)
        bounds = sorted({0, flat.numel(), *[flat.numel() * k // (cuts + 1) for k in (1, 3)]})
        for lo, hi in itertools.pairwise(bounds):
            out += entries_of_flat_range(name, tuple(t.shape), lo, flat[lo:hi].clone())
    return out


def _save(root: Path, step: int, seed: int | None = None, keep_last: int | None = None) -> Path:
    full = _state(step if seed is None else seed)
    state = {"global_step": step, "lr": 0.1}
    return save_checkpoint(
        root, step, _entries(full), state, {"rng": step}, keep_last=keep_last, group=comm.world()
    )


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip(tmp_path: Path) -> None:
    path = _save(tmp_path, 7)
    assert path == tmp_path / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST_NAME, RANK_FILE, SHARD]
    report = verify(path)
    assert (report.step, report.world_size, report.num_files) == (7, 1, 2)
    with CheckpointReader(tmp_path) as reader:
        full = _state(7)
        assert reader.names() == sorted(full)
        for name, t in full.items():
            assert reader.full_shape(name) == tuple(t.shape)
            got = reader.read_full(name)
            assert got.dtype == t.dtype and torch.equal(got, t)
        assert reader.trainer_state == {"global_step": 7, "lr": 0.1}
        assert reader.rank_state(0) == {"rng": 7}
        assert reader.manifest.format_version == 2
        pieces = reader.manifest.tensors["model/embed.weight"].pieces
        # flat ranges [0, 5), [5, 15), [15, 20) of a 5x4 tensor: 2 + 3 + 2 boxes
        assert [(p.offsets, p.shape) for p in pieces] == [
            ((0, 0), (1, 4)),
            ((1, 0), (1, 1)),
            ((1, 1), (1, 3)),
            ((2, 0), (1, 4)),
            ((3, 0), (1, 3)),
            ((3, 3), (1, 1)),
            ((4, 0), (1, 4)),
        ]
        assert all(p.key == f"model/embed.weight@{p.offsets[0]},{p.offsets[1]}" for p in pieces)
    doc = json.loads((path / MANIFEST_NAME).read_text())
    assert doc["files"][SHARD]["sha256"] and doc["step"] == 7 and doc["world_size"] == 1
    records = [
        json.loads(line.split(" ", 1)[1])
        for line in (tmp_path / JOURNAL_NAME).read_text().splitlines()
    ]
    assert [(r["op"], r["step"]) for r in records] == [("begin", 7), ("commit", 7)]


def test_read_range_across_pieces(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    flat = _state(1)["model/embed.weight"].reshape(-1)
    with CheckpointReader(tmp_path, verify=False) as reader:
        for lo, hi in [(0, 20), (3, 17), (4, 5), (9, 9), (0, 1), (19, 20)]:
            assert torch.equal(reader.read_range("model/embed.weight", lo, hi), flat[lo:hi])
        with pytest.raises(ValueError, match="0 <= start <= stop <= 20"):
            reader.read_range("model/embed.weight", 5, 21)
        with pytest.raises(KeyError, match="names"):
            reader.read_full("model/missing")


@pytest.mark.parametrize(
    "case, match",
    [
        ("gap", r"elements \[3, 5\) are held by no rank"),
        ("overlap", "overlap"),
        ("shape", "every rank must describe the same full tensor"),
        ("dims", "one offset and one tensor dim per dim"),
        ("outside", r"must lie within global_shape \(6,\)"),
    ],
)
def test_coverage_errors(tmp_path: Path, case: str, match: str) -> None:
    _save(tmp_path, 1)
    t = torch.arange(6.0)
    entries = {
        "gap": [ShardEntry("w", (6,), (0,), t[:3]), ShardEntry("w", (6,), (5,), t[5:])],
        "overlap": [ShardEntry("w", (6,), (0,), t[:4]), ShardEntry("w", (6,), (3,), t[3:])],
        "shape": [
            ShardEntry("w", (6,), (0,), t[:3]),
            ShardEntry("w", (2, 3), (1, 0), t[3:].reshape(1, 3)),
        ],
        "dims": [ShardEntry("w", (6,), (0,), t.reshape(2, 3))],
        "outside": [ShardEntry("w", (6,), (4,), t[:4])],
    }[case]
    with pytest.raises(ValueError, match=match):
        save_checkpoint(tmp_path, 2, entries, {}, None, group=comm.world())
    assert resolve(tmp_path) == tmp_path / step_dir_name(1)
    assert not (tmp_path / tmp_dir_name(2)).exists()
    assert not (tmp_path / step_dir_name(2)).exists()


def test_flipped_byte_in_shard_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    _flip_byte(path / SHARD, (path / SHARD).stat().st_size - 2)
    with pytest.raises(CheckpointError, match="wrong checksum") as info:
        verify(path)
    assert info.value.path == path / SHARD
    with pytest.raises(CheckpointError, match=SHARD):
        CheckpointReader(path)
    ok, message = verify_cli(path)
    assert not ok and SHARD in message


def test_missing_file_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    (path / RANK_FILE).unlink()
    with pytest.raises(CheckpointError, match="file is missing") as info:
        verify(path)
    assert info.value.path == path / RANK_FILE


def test_truncated_manifest_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    data = (path / MANIFEST_NAME).read_bytes()
    (path / MANIFEST_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or not valid JSON") as info:
        verify(path)
    assert info.value.path == path / MANIFEST_NAME


def test_unknown_format_version_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    doc = json.loads((path / MANIFEST_NAME).read_text())
    doc["format_version"] = 99
    (path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="unknown format_version 99"):
        verify(path)


def test_changed_manifest_does_not_match_journal(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    doc = json.loads((path / MANIFEST_NAME).read_text())
    doc["trainer_state"]["lr"] = 1.0
    (path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"does not match .* journal's commit record"):
        verify(path)


def test_torn_journal_tail_is_no_record(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    journal = tmp_path / JOURNAL_NAME
    data = journal.read_bytes()
    journal.write_bytes(data[:-10])  # the crash hit while appending "commit 2"
    assert resolve(tmp_path) == tmp_path / step_dir_name(1)
    with pytest.raises(CheckpointError, match="torn") as info:
        verify(second)
    assert info.value.path == journal
    # The next save repairs the tail, removes the uncommitted step 2 and commits step 3.
    _save(tmp_path, 3)
    assert not second.exists()
    assert journal.read_bytes().endswith(b"\n")
    assert Journal(tmp_path).read().live_steps() == [1, 3]


def test_damaged_commit_record_invalidates_the_step(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    journal = tmp_path / JOURNAL_NAME
    lines = journal.read_bytes().split(b"\n")
    lines[-2] = lines[-2].replace(b'"op":"commit"', b'"op":"cOmmit"')  # last complete line
    journal.write_bytes(b"\n".join(lines))
    with pytest.raises(CheckpointError, match=r"line 4 .* is damaged"):
        verify(second)
    path, skipped = find_latest_valid(tmp_path)
    assert path == tmp_path / step_dir_name(1)
    assert [p for p, _ in skipped] == [second]


def test_find_latest_valid_falls_back(tmp_path: Path) -> None:
    assert find_latest_valid(tmp_path) == (None, [])
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _flip_byte(tmp_path / step_dir_name(3) / SHARD, 100)
    (tmp_path / step_dir_name(2) / MANIFEST_NAME).write_text("{")
    path, skipped = find_latest_valid(tmp_path)
    assert path == tmp_path / step_dir_name(1)
    assert [(p.name, "wrong checksum" in r or "not valid JSON" in r) for p, r in skipped] == [
        ("step-00000003", True),
        ("step-00000002", True),
    ]
    assert SHARD in skipped[0][1] and MANIFEST_NAME in skipped[1][1]


def test_retention_keep_last(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step-00000030",
        "step-00000040",
    ]
    state = Journal(tmp_path).read()
    assert state.live_steps() == [30, 40] and state.deleted == {10, 20}
    with pytest.raises(CheckpointError, match="deleted"):
        verify(tmp_path / step_dir_name(20))


def test_same_step_twice_is_an_error(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    with pytest.raises(ValueError, match="already committed"):
        _save(tmp_path, 5, seed=99)
    delete_checkpoint(tmp_path, 5)
    _save(tmp_path, 5, seed=99)
    with CheckpointReader(tmp_path) as reader:
        assert torch.equal(reader.read_full("optim/step"), torch.tensor([99]))


def test_interrupted_save_leftovers(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    tmp = tmp_path / tmp_dir_name(2)
    tmp.mkdir()
    (tmp / SHARD).write_bytes(b"partial")
    renamed = tmp_path / step_dir_name(3)  # renamed, then the commit record never came
    renamed.mkdir()
    (renamed / MANIFEST_NAME).write_text("{}")
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(encode_record("begin", 2) + encode_record("begin", 3))
    assert resolve(tmp_path) == tmp_path / step_dir_name(1)
    path, skipped = find_latest_valid(tmp_path)
    assert path == tmp_path / step_dir_name(1) and [p for p, _ in skipped] == [renamed]
    assert "never committed" in skipped[0][1]
    _save(tmp_path, 4)
    assert not tmp.exists() and not renamed.exists()
    assert Journal(tmp_path).read().live_steps() == [1, 4]


def test_bad_trainer_state_and_rank_state(tmp_path: Path) -> None:
    entries = [ShardEntry("w", (2,), (0,), torch.ones(2))]
    with pytest.raises(ValueError, match="JSON-serializable"):
        save_checkpoint(tmp_path, 1, entries, {"x": object()}, None, group=comm.world())
    with pytest.raises(TypeError, match="nothing is pickled"):
        save_checkpoint(tmp_path, 1, entries, {}, lambda: 0, group=comm.world())
    assert find_latest_valid(tmp_path) == (None, [])


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.proj = torch.nn.Linear(4, 6)
        self.proj.weight = self.embed.weight  # tied


def test_export_round_trip(tmp_path: Path) -> None:
    src = _Tiny()
    full = {f"model/{k}": v.detach().to(torch.bfloat16) for k, v in src.state_dict().items()}
    full["optim/proj.bias/exp_avg"] = torch.zeros(6)
    save_checkpoint(tmp_path / "ck", 1, _entries(full), {}, None, group=comm.world())
    names, naming = export_consolidated(tmp_path / "ck", tmp_path / "model.safetensors")
    assert names == ["embed.weight", "proj.bias", "proj.weight"] and "plain" in naming
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in loaded.values())
    dst = _Tiny()
    dst.load_state_dict(loaded)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v.to(torch.bfloat16).float())


def test_inspect_summary(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    text = inspect(tmp_path)
    assert "step: 4" in text and "world size: 1" in text and "format version: 2" in text
    assert "tensors: 4" in text and "verification: OK" in text
    model_bytes = 20 * 4 + 3 * 2
    assert f"model/: 2 tensors, {model_bytes} bytes" in text
    assert "optim/: 2 tensors" in text
    os.truncate(tmp_path / step_dir_name(4) / SHARD, 10)
    assert "verification: FAILED" in inspect(tmp_path)
    assert "unreadable" in inspect(tmp_path / "nowhere")


def test_async_writer_single_rank(tmp_path: Path) -> None:
    full = _state(8)
    entries = _entries(full)
    with AsyncCheckpointWriter(tmp_path, keep_last=1, timeout_s=30, group=comm.world()) as writer:
        writer.save(8, entries, {"global_step": 8}, {"rng": 8})
        for e in entries:  # the writer snapshotted: later changes do not leak in
            e.tensor.zero_()
        assert writer.wait() == tmp_path / step_dir_name(8)
        writer.save(9, _entries(_state(9)), {"global_step": 9}, None)
    assert Journal(tmp_path).read().live_steps() == [9]
    with CheckpointReader(tmp_path / step_dir_name(9)) as reader:
        assert torch.equal(reader.read_full("model/embed.weight"), _state(9)["model/embed.weight"])
    writer = AsyncCheckpointWriter(tmp_path, timeout_s=30, group=comm.world())
    writer.save(9, entries, {}, None)
    with pytest.raises(ValueError, match="already committed"):
        writer.wait()


def test_empty_tensor_and_numel(tmp_path: Path) -> None:
    entries = [
        ShardEntry("model/empty", (0, 3), (0, 0), torch.empty(0, 3)),
        ShardEntry("model/w", (2, 2), (0, 0), torch.arange(4.0).reshape(2, 2)),
    ]
    save_checkpoint(tmp_path, 1, entries, {}, None, group=comm.world())
    with CheckpointReader(tmp_path) as reader:
        assert reader.read_full("model/empty").shape == (0, 3)
        assert math.prod(reader.full_shape("model/w")) == 4


def test_views_and_dtypes(tmp_path: Path) -> None:
    base = torch.arange(40.0)
    full = {
        "a": base[10:30],  # a view with a storage offset
        "b": base[::2].clone().to(torch.float16),
        "c": torch.tensor([True, False, True, True]),
        "d": torch.arange(-3, 3, dtype=torch.int8),
        "e": torch.linspace(-2, 2, 6).to(torch.float8_e4m3fn),
    }
    entries = [ShardEntry("a", (20,), (0,), base[10:17]), ShardEntry("a", (20,), (7,), base[17:30])]
    entries.append(ShardEntry("b", (20,), (0,), full["b"].reshape(4, 5).t().reshape(-1)[:0]))
    entries.append(ShardEntry("b", (20,), (0,), full["b"]))
    entries += [ShardEntry(n, (t.numel(),), (0,), t) for n, t in full.items() if n in "cde"]
    save_checkpoint(tmp_path, 1, entries, {}, None, group=comm.world())
    with CheckpointReader(tmp_path) as reader:
        for name, t in full.items():
            got = reader.read_full(name)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(reader.read_range("a", 5, 9), base[15:19])

"""Corpus loading and splitting; the data-parallel batch sampler."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardwise.data import Corpus, DistributedBatchSampler, load_corpus


@pytest.fixture(scope="module")
def stdlib_corpus() -> Corpus:
    return load_corpus(max_bytes=1_000_000)


def test_stdlib_corpus_loads_with_cap(stdlib_corpus: Corpus) -> None:
    c = stdlib_corpus
    assert c.name.startswith("stdlib:")
    assert c.train.dtype == torch.uint8 and c.val.dtype == torch.uint8
    assert c.train.dim() == 1 and c.val.numel() > 0
    assert c.train.numel() + c.val.numel() == 1_000_000
    assert c.num_docs > 1
    text = Corpus.decode(c.train[:2000])
    assert "def " in text or "import " in text
    # A unigram model of Python source sits well below the uniform ln(256) = 5.55 nats.
    assert 2.0 < c.unigram_entropy() < 5.0


def test_stdlib_split_deterministic(stdlib_corpus: Corpus) -> None:
    again = load_corpus(max_bytes=1_000_000)
    assert torch.equal(again.train, stdlib_corpus.train)
    assert torch.equal(again.val, stdlib_corpus.val)


def _write_docs(root: Path, n: int) -> list[bytes]:
    docs = []
    for i in range(n):
        data = f"document {i}: {'abcdefghij'[i % 10] * (20 + i)}\n".encode()
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_bytes(data)
        docs.append(data)
    return docs


def test_directory_split_is_by_document_and_disjoint(tmp_path: Path) -> None:
    docs = _write_docs(tmp_path, 200)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    corpus = load_corpus(str(tmp_path), val_fraction=0.2)
    assert corpus.num_docs == 200  # binary and non-UTF-8 files skipped
    train, val = bytes(corpus.train.tolist()), bytes(corpus.val.tolist())
    assert len(train) + len(val) == sum(len(d) for d in docs)
    in_val = [d for d in docs if d in val]
    in_train = [d for d in docs if d in train]
    assert in_val and in_train
    assert not set(in_val) & set(in_train)
    assert len(in_val) + len(in_train) == 200
    assert torch.equal(load_corpus(str(tmp_path), val_fraction=0.2).val, corpus.val)


def test_single_file_splits_tail(tmp_path: Path) -> None:
    f = tmp_path / "one.txt"
    f.write_text("hello world, " * 100)
    corpus = load_corpus(str(f))
    joined = torch.cat([corpus.train, corpus.val])
    assert bytes(joined.tolist()) == f.read_bytes()
    assert corpus.val.numel() == int(0.05 * f.stat().st_size)


def test_corpus_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        load_corpus(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_corpus(str(tmp_path / "empty"))
    blank = tmp_path / "blank.txt"
    blank.write_text("")
    with pytest.raises(ValueError, match="blank"):
        load_corpus(str(blank))
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("secret")
        locked.chmod(0)
        with pytest.raises(ValueError, match="locked"):
            load_corpus(str(locked))


def _tokens(n: int = 5000) -> torch.Tensor:
    # Token i is i, so a window's first input token is its offset.
    return torch.arange(n, dtype=torch.int64)


def test_sampler_shapes_and_shift() -> None:
    s = DistributedBatchSampler(_tokens(), seq_len=16, micro_batch=4, dp_rank=0, dp_size=1)
    x, y = s.next_batch()
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_rank_parts_disjoint_and_union_is_global(grad_accum: int) -> None:
    tokens, dp_size, mb = _tokens(), 3, 2
    samplers = [
        DistributedBatchSampler(tokens, 16, mb, r, dp_size, seed=5, grad_accum=grad_accum)
        for r in range(dp_size)
    ]
    for step in range(4):
        parts = [torch.cat([s.next_batch()[0] for _ in range(grad_accum)]) for s in samplers]
        gx, _ = samplers[0].global_batch(step)
        assert torch.equal(torch.cat(parts), gx)
        starts = [set(p[:, 0].tolist()) for p in parts]
        assert sum(len(s) for s in starts) == len(set().union(*starts)) == gx.shape[0]


def test_global_batch_same_at_every_dp_size() -> None:
    tokens, global_size = _tokens(), 12
    reference = None
    for dp_size in (1, 2, 3, 4):
        samplers = [
            DistributedBatchSampler(tokens, 16, global_size // dp_size, r, dp_size, seed=7)
            for r in range(dp_size)
        ]
        steps = []
        for _ in range(3):
            steps.append(torch.cat([s.next_batch()[0] for s in samplers]))
        if reference is None:
            reference = steps
        for got, want in zip(steps, reference, strict=True):
            assert torch.equal(got, want)


def test_epoch_covers_every_window_once() -> None:
    tokens = _tokens(16 * 10 + 1)  # exactly 10 windows
    s = DistributedBatchSampler(tokens, 16, micro_batch=5, dp_rank=0, dp_size=1, seed=3)
    epoch = torch.cat([s.next_batch()[0] for _ in range(2)])
    assert sorted(epoch[:, 0].tolist()) == (torch.arange(10) * 16).tolist()
    assert s.epoch == 1
    nxt = torch.cat([s.next_batch()[0] for _ in range(2)])
    assert not torch.equal(nxt, epoch)  # a new permutation


def test_seed_changes_order() -> None:
    a = DistributedBatchSampler(_tokens(), 16, 4, 0, 1, seed=0).next_batch()[0]
    b = DistributedBatchSampler(_tokens(), 16, 4, 0, 1, seed=1).next_batch()[0]
    assert not torch.equal(a, b)


def test_state_dict_resume() -> None:
    tokens = _tokens(16 * 20 + 1)
    s = DistributedBatchSampler(tokens, 16, 3, dp_rank=1, dp_size=2, seed=2, grad_accum=2)
    for _ in range(15):  # crosses epoch boundaries and stops mid-accumulation
        s.next_batch()
    state = s.state_dict()
    assert set(state) >= {"epoch", "position"}
    expected = [s.next_batch() for _ in range(5)]
    resumed = DistributedBatchSampler(tokens, 16, 3, dp_rank=1, dp_size=2, seed=2, grad_accum=2)
    resumed.load_state_dict(state)
    for (ex, ey), (gx, gy) in zip(expected, [resumed.next_batch() for _ in range(5)], strict=True):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)
    other_seed = DistributedBatchSampler(tokens, 16, 3, dp_rank=1, dp_size=2, seed=9)
    with pytest.raises(ValueError, match="seed"):
        other_seed.load_state_dict(state)


def test_resume_at_other_dp_size_on_batch_boundary() -> None:
    tokens = _tokens()
    two = [DistributedBatchSampler(tokens, 16, 2, r, 2, seed=4) for r in range(2)]
    for _ in range(3):
        for s in two:
            s.next_batch()
    one = DistributedBatchSampler(tokens, 16, 4, 0, 1, seed=4)
    one.load_state_dict(two[0].state_dict())
    assert torch.equal(one.next_batch()[0], torch.cat([s.next_batch()[0] for s in two]))


def test_sampler_errors() -> None:
    with pytest.raises(ValueError, match="shorter than one sequence"):
        DistributedBatchSampler(_tokens(16), seq_len=16, micro_batch=1, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="micro_batch"):
        DistributedBatchSampler(_tokens(), seq_len=16, micro_batch=0, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="grad_accum"):
        DistributedBatchSampler(_tokens(), 16, 1, 0, 1, grad_accum=0)
    with pytest.raises(ValueError, match="dp_rank"):
        DistributedBatchSampler(_tokens(), 16, 1, dp_rank=2, dp_size=2)

"""Mistakes a user can fix are one line and exit code 2 from the launcher, before any rank
starts: bad corpora, config syntax, damaged config.json, unwritable run directories, sizes that
cannot fit; and a corpus with a non-UTF-8 file name loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_cli import _error_line

from shardwise.config import Config
from shardwise.data import load_corpus
from shardwise.train.options import RunConfig, TrainOptions

TINY = ["--model", "tiny", "--steps", "2", "--eval-every", "0"]


def _train_error(capsys: pytest.CaptureFixture[str], run_dir: Path, *argv: str) -> str:
    line = _error_line(capsys, "train", *TINY, "--run-dir", str(run_dir), *argv)
    assert not (run_dir / "config.json").exists()
    return line


def test_empty_binary_and_too_small_corpora(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    assert "has 0 bytes of UTF-8 text" in _train_error(
        capsys, tmp_path / "r1", "--data", str(empty)
    )
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "a.bin").write_bytes(bytes(range(256)) * 20)
    (binary / "b.txt").write_bytes(b"\xff\xfe not utf-8 \xc3\x28" * 50)
    line = _train_error(capsys, tmp_path / "r2", "--data", str(binary))
    assert "0 bytes of UTF-8 text (2 file(s) read" in line
    small = tmp_path / "small.txt"
    small.write_text("x" * 1000)
    line = _train_error(capsys, tmp_path / "r3", "--data", str(small))
    assert "is too small: its validation split has 50 bytes, and a sequence needs 65" in line


def test_non_utf8_file_names_load():
    root = Path(os.fsdecode(b"/tmp")) / f"sw-corpus-{os.getpid()}"
    root.mkdir(exist_ok=True)
    try:
        for i in range(25):
            (root / os.fsdecode(b"doc-\xff%d.txt" % i)).write_text(f"text number {i}\n" * 40)
        corpus = load_corpus(str(root))
        assert corpus.num_docs == 25 and corpus.train.numel() > 0 and corpus.val.numel() > 0
    finally:
        for p in root.iterdir():
            p.unlink()
        root.rmdir()


def test_config_file_errors_are_one_line(capsys, tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("zero_stage: [2\nprecision: bf16\n")
    line = _train_error(capsys, tmp_path / "run", "--config", str(bad))
    assert f"config file {bad} is not valid YAML" in line
    truthy = tmp_path / "c.json"
    truthy.write_text('{"offload_optimizer": "false"}')
    line = _train_error(capsys, tmp_path / "run", "--config", str(truthy))
    assert f"config file {truthy}: offload_optimizer must be true or false" in line


def test_damaged_config_json_names_the_file_on_resume(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"train": ')
    line = _error_line(capsys, "train", "--resume", "--run-dir", str(run_dir))
    assert f"{run_dir / 'config.json'} is not valid JSON" in line
    run = RunConfig(
        train=TrainOptions(model="tiny"), engine=Config(micro_batch_size=2), world_size=2
    )
    data = run.to_dict()
    data["shardwise"]["async_save"] = "no"
    (run_dir / "config.json").write_text(json.dumps(data))
    line = _error_line(capsys, "train", "--resume", "--run-dir", str(run_dir))
    assert f"{run_dir / 'config.json'}: " in line and "async_save must be true or false" in line


def test_an_unwritable_run_dir_is_refused(capsys, tmp_path):
    if not Path("/sys").is_dir():
        pytest.skip("needs /sys, a filesystem nobody may create directories in")
    line = _error_line(capsys, "train", *TINY, "--run-dir", "/sys/shardwise-run")
    assert "cannot create the run directory /sys/shardwise-run" in line


def test_a_full_disk_is_refused(capsys, tmp_path):
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip("mounting a small tmpfs needs privileges this machine does not give")
    try:
        filler = mount / "filler"
        with open(filler, "wb") as f:
            try:
                f.write(b"x" * 65536)
            except OSError:
                pass
        line = _error_line(capsys, "train", *TINY, "--run-dir", str(mount / "run"))
        assert "No space left on device" in line
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", *TINY, "--micro-batch", "1000000000000"], "--micro-batch must be <= 2147483647"),
        (["train", *TINY, "--micro-batch", "1000000000"], "lower --micro-batch or --seq-len"),
        (
            ["estimate", "--params", "1e30"],
            "--params must be a whole number in 1..1,000,000,000,000,000, got '1e30'",
        ),
        (["estimate", "--model", "small", "--micro-batch", "1000000000000"], "--micro-batch must"),
    ],
)
def test_sizes_that_cannot_fit_are_refused(capsys, tmp_path, argv, expected):
    if argv[0] == "train":
        argv = [*argv, "--run-dir", str(tmp_path / "run")]
    assert expected in _error_line(capsys, *argv)


def test_generate_bounds_tokens(capsys, tmp_path):
    line = _error_line(capsys, "generate", str(tmp_path), "--tokens", "100000000")
    assert "--tokens 100000000 is more than 100,000" in line


def test_entry_point_prints_no_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "train", *TINY, "--data", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr

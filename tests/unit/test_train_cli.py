"""``shardwise train`` option checks, ``estimate``, ``report`` and ``generate`` without ranks."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardwise.cli.estimate_cmd import parse_count
from shardwise.cli.main import main
from shardwise.config import Config
from shardwise.estimate import estimate_model_states, format_bytes
from shardwise.models.gpt import GPT
from shardwise.train.lr_schedule import lr_at
from shardwise.train.metrics import MetricsWriter, read_metrics
from shardwise.train.options import RunConfig, TrainOptions
from shardwise.train.rundir import RunDir
from shardwise.train.summary import build_summary, write_summary

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"shardwise {argv[0]}: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
        (["--zero", "5"], "--zero must be one of 0, 1, 2, 3, got 5"),
        (["--data", "/no/such/corpus"], "--data path '/no/such/corpus' does not exist"),
        (["--model", "huge"], "--model 'huge' is unknown: choose one of tiny"),
        (["--precision", "fp8"], "--precision must be one of fp32, bf16, fp16"),
        (["--steps", "0"], "--steps must be an int >= 1, got 0"),
        (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    ],
)
def test_bad_train_options_are_one_line(capsys, tmp_path, argv, expected):
    run_dir = tmp_path / "run"
    line = _error_line(capsys, "train", "--run-dir", str(run_dir), *argv)
    assert expected in line
    assert not run_dir.exists(), "a rejected run must not create its directory"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nproc-per-node", "3", "--tp", "2"], "--tp 2 does not divide the 3 ranks"),
        (["--tp", "0"], "--tp must be an int >= 1, got 0"),
        # tiny: n_head=2, d_model=64
        (["--nproc-per-node", "4", "--tp", "4"], "--tp 4 does not divide the tiny model's"),
        (["--sequence-parallel"], "--sequence-parallel splits the sequence over tp ranks"),
        (
            ["--tp", "2", "--sequence-parallel", "--seq-len", "33"],
            "sequence length 33 divisible by --tp 2",
        ),
        (["--nproc-per-node", "3", "--dp-replicate", "2"], "--dp-replicate 2 does not divide"),
        (["--dp-replicate", "0"], "--dp-replicate must be an int >= 1, got 0"),
        (
            ["--nproc-per-node", "4", "--dp-replicate", "3", "--pp", "2"],
            "--dp-replicate 3 does not divide the 2 data-parallel ranks",
        ),
    ],
)
def test_bad_tensor_parallel_layouts_are_one_line(capsys, tmp_path, argv, expected):
    run_dir = tmp_path / "run"
    base = ["--model", "tiny", "--nproc-per-node", "2"]
    line = _error_line(capsys, "train", "--run-dir", str(run_dir), *base, *argv)
    assert expected in line
    assert not run_dir.exists(), "a rejected run must not create its directory"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--pp", "3"], "--pp 3 does not divide the 2 ranks"),
        (["--nproc-per-node", "4", "--pp", "2", "--tp", "4"], "--tp 4 x --pp 2 does not divide"),
        (
            ["--nproc-per-node", "8", "--pp", "8"],
            "2 transformer blocks cannot fill 8 pipeline stages",
        ),
        (["--pp", "2", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
        (["--pp", "2", "--microbatches", "3"], "--micro-batch 8 does not split into"),
        (["--pp", "2", "--schedule", "pipedream"], "--schedule must be one of gpipe, 1f1b"),
        (
            ["--pp", "2", "--schedule", "interleaved_1f1b", "--microbatches", "3"],
            "interleaved_1f1b needs --microbatches divisible by --pp 2, got 3: use 2 or 4",
        ),
        (["--microbatches", "2"], "--microbatches describes a pipeline: add --pp > 1"),
        (["--schedule", "gpipe"], "--schedule describes a pipeline: add --pp > 1"),
    ],
)
def test_bad_pipeline_options_are_one_line(capsys, tmp_path, argv, expected):
    run_dir = tmp_path / "run"
    base = ["--model", "tiny", "--nproc-per-node", "2"]
    line = _error_line(capsys, "train", "--run-dir", str(run_dir), *base, *argv)
    assert expected in line
    assert not run_dir.exists(), "a rejected run must not create its directory"


def test_tensor_parallel_run_config_counts_dp_replicas(tmp_path):
    run = RunConfig(
        train=TrainOptions(model="tiny", tp=2, sequence_parallel=True),
        engine=Config(micro_batch_size=4, gradient_accumulation_steps=3),
        world_size=4,
    )
    run.write(tmp_path / "config.json")
    back = RunConfig.read(tmp_path / "config.json")
    assert back.train.tp == 2 and back.train.sequence_parallel
    assert back.dp_size == 2 and back.layout() == "dp2 x tp2"
    assert back.global_batch_size == 4 * 3 * 2  # tp peers read the same sequences
    assert back.params_per_rank() < back.model.param_count()


def test_hierarchical_sharding_run_config_names_its_replicas(tmp_path):
    run = RunConfig(
        train=TrainOptions(model="tiny", dp_replicate=2),
        engine=Config(micro_batch_size=2, zero_stage=3),
        world_size=4,
    )
    run.write(tmp_path / "config.json")
    back = RunConfig.read(tmp_path / "config.json")
    assert back.train.dp_replicate == 2 and back.dp_size == 4
    assert back.layout() == "dp4 (2 replicas of 2)"
    assert back.global_batch_size == 2 * 4  # every dp rank reads its own sequences


def test_resume_and_reuse_errors(capsys, tmp_path):
    line = _error_line(capsys, "train", "--resume", "--run-dir", str(tmp_path / "none"))
    assert "does not exist" in line
    run = RunConfig(
        train=TrainOptions(model="tiny"), engine=Config(micro_batch_size=4), world_size=2
    )
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run.write(run_dir.config)
    assert "already holds a run" in _error_line(capsys, "train", "--run-dir", str(run_dir.root))
    line = _error_line(
        capsys, "train", "--resume", "--run-dir", str(run_dir.root), "--model", "small"
    )
    assert "--model cannot change when resuming" in line


def test_bad_option_through_the_entry_point_has_no_traceback(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardwise.cli.main",
            "train",
            "--zero",
            "5",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "shardwise train: error: --zero must be one of 0, 1, 2, 3, got 5"


def test_run_config_round_trip(tmp_path):
    run = RunConfig(
        train=TrainOptions(model="tiny", steps=7, seq_len=32),
        engine=Config(zero_stage=2, micro_batch_size=4, gradient_accumulation_steps=3),
        world_size=2,
    )
    run.write(tmp_path / "config.json")
    back = RunConfig.read(tmp_path / "config.json")
    assert back.to_dict() == run.to_dict()
    derived = json.loads((tmp_path / "config.json").read_text())["derived"]
    assert derived["global_batch_size"] == 4 * 3 * 2
    assert derived["tokens_per_step"] == 4 * 3 * 2 * 32


def test_lr_schedule_warmup_then_cosine():
    kw = {"peak": 1e-3, "total": 100, "warmup": 10, "min_ratio": 0.1}
    assert lr_at(0, **kw) == pytest.approx(1e-4)
    assert lr_at(9, **kw) == pytest.approx(1e-3)
    assert lr_at(99, **kw) == pytest.approx(1e-4)
    values = [lr_at(s, **kw) for s in range(10, 100)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_metrics_resume_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for step in range(1, 6):
            w.write({"step": step, "loss": float("nan") if step == 5 else 1.0})
    assert read_metrics(path)[-1]["loss"] is None  # NaN is stored as null
    with MetricsWriter(path, resume_step=3) as w:
        w.write({"step": 4, "loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_parse_count():
    assert parse_count("7e9") == 7_000_000_000
    assert parse_count("125M") == 125_000_000
    assert parse_count("1.5b") == 1_500_000_000
    with pytest.raises(ValueError, match="not a count"):
        parse_count("lots")


def test_estimate_params_table(capsys):
    assert (
        main(
            [
                "estimate",
                "--params",
                "7e9",
                "--world-size",
                "64",
                "--precision",
                "bf16",
                "--device-memory",
                "80GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    est = estimate_model_states(7_000_000_000, 64, "bf16")
    rows: dict[str, str] = {}
    for line in out.splitlines():  # the first table (model states); the init peak's follows
        if line.split()[:1] in (["0"], ["1"], ["2"], ["3"]):
            rows.setdefault(line.split()[0], line)
    assert set(rows) == {"0", "1", "2", "3"}
    assert format_bytes(est[3].params_bytes) in rows["3"]
    assert rows["0"].endswith("no") and rows["3"].endswith("yes")


def test_estimate_model_adds_activations(capsys):
    assert main(["estimate", "--model", "small", "--micro-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "842,496 parameters" in out
    assert "with activation checkpointing" in out and "peak (act. ckpt)" in out
    assert _error_line(capsys, "estimate", "--model", "huge").endswith(
        "choose one of tiny, small, medium, anchor, gpt2"
    )


def _synthetic_run(root: Path, steps: int, finished: bool) -> RunDir:
    run = RunConfig(
        train=TrainOptions(model="tiny", steps=steps, eval_every=10),
        engine=Config(zero_stage=2, micro_batch_size=4),
        world_size=2,
    )
    run_dir = RunDir(root)
    root.mkdir()
    run.write(run_dir.config)
    records = []
    with MetricsWriter(run_dir.metrics) as w:
        for step in range(1, steps + 1):
            mem = {
                "params": 480_000,
                "grads": 240_000,
                "optimizer": 960_000,
                "buffers": 0,
                "comm": 4096,
            }
            record = {
                "step": step,
                "loss": 5.5 * math.exp(-step / 15) + 2.0,
                "lr": 1e-3,
                "tokens": 512,
                "tokens_per_s": 9000.0 + 100 * (step % 7),
                "step_time_s": 0.05,
                "exposed_comm_s": [0.01, 0.012],
                "comm": {
                    "all_gather": {"calls": 2, "bytes": 960_000, "seconds": 0.02},
                    "reduce_scatter": {"calls": 1, "bytes": 480_000, "seconds": 0.01},
                },
                "memory": [mem, mem],
                "elapsed_s": step * 0.06,
            }
            if step % 10 == 0:
                record["val_loss"] = record["loss"] + 0.1
            w.write(record)
            records.append(record)
    if finished:
        write_summary(
            run_dir.summary,
            build_summary(
                run,
                records,
                status="finished",
                unigram_baseline=3.2,
                final_val_loss=records[-1].get("val_loss"),
                wall_time_s=4.0,
            ),
        )
    return run_dir


@pytest.mark.parametrize("finished", [True, False])
def test_report_writes_pngs_and_html(capsys, tmp_path, finished):
    run_dir = _synthetic_run(tmp_path / "run", 40, finished)
    assert main(["report", str(run_dir.root)]) == 0
    written = [Path(p) for p in capsys.readouterr().out.split()]
    names = sorted(p.name for p in written)
    assert names == ["comm.png", "loss.png", "memory.png", "report.html", "throughput.png"]
    for path in written:
        assert path.parent == run_dir.report
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == PNG_MAGIC
    page = (run_dir.report / "report.html").read_text()
    assert page.count("<img ") == 4 and "estimated vs measured" in page
    assert ("unigram baseline" in page) and ("3.200 nats" in page) == finished


def test_report_of_a_missing_run_is_one_line(capsys, tmp_path):
    assert "does not exist" in _error_line(capsys, "report", str(tmp_path / "nothing"))


def test_generate_from_final_model(capsys, tmp_path):
    run_dir = _synthetic_run(tmp_path / "run", 3, finished=True)
    torch.manual_seed(0)
    model = GPT(RunConfig.read(run_dir.config).model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(state, str(run_dir.final_model), metadata={"step": "3"})
    assert (
        main(
            [
                "generate",
                str(run_dir.root),
                "--prompt",
                "def ",
                "--tokens",
                "20",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("def ") and len(captured.out) > len("def ")
    assert "step 3" in captured.err
    assert "--top-k must be >= 1" in _error_line(
        capsys, "generate", str(run_dir.root), "--top-k", "0"
    )

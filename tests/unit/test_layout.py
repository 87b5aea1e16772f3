"""One layout check for ``plan``, ``estimate``, ``pipeline simulate`` and ``train``
(``shardwise.parallel.layout``), and every refusal of #22 as a user meets it: exit code 2 and
one line naming what is wrong and what would work, no traceback."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from test_train_cli import _error_line

from shardwise.cli.main import main
from shardwise.costmodel import hardware, shape
from shardwise.costmodel.search import rank_plans
from shardwise.models.gpt import GPTConfig
from shardwise.parallel.layout import (
    ESTIMATE_FLAGS,
    MAX_DEVICES,
    Layout,
    check_layout,
    divisors,
    gpt_dims,
)
from shardwise.parallel.pipeline.simulate import simulate

TINY = gpt_dims("tiny", GPTConfig.named("tiny"))  # 2 blocks, 2 heads, d_model 64


@pytest.mark.parametrize(
    ("layout", "batch", "expected"),
    [
        (Layout(world_size=3, tp=2), {}, "--tp 2 does not divide --world-size 3: use "
         "--world-size 2 or 4, or degrees whose product divides 3 (1 or 3)"),
        (Layout(world_size=4, tp=2, pp=4), {}, "--tp 2 x --pp 4 does not divide"),
        (Layout(world_size=2, sequence_parallel=True), {}, "--sequence-parallel splits the "
         "sequence over tp ranks: add --tp > 1"),
        (Layout(world_size=6, dp_replicate=4), {}, "--dp-replicate 4 does not divide the 6 "
         "data-parallel ranks: use 3 or 6"),
        (Layout(world_size=4, tp=4), {}, "--tp 4 does not divide the tiny model's n_head=2 "
         "heads and d_model=64: use 2"),
        (Layout(world_size=4, pp=4), {}, "the tiny model's 2 transformer blocks cannot fill 4 "
         "pipeline stages (--pp 4), each needs a block: use --pp <= 2"),
        (Layout(world_size=2, pp=2, schedule="interleaved_1f1b", microbatches=2,
                virtual_stages=2), {}, "cannot fill 4 pipeline stages (--pp 2 x "
         "--virtual-stages 2)"),
        (Layout(world_size=1, microbatches=4), {}, "--microbatches describes a pipeline: add "
         "--pp > 1"),
        (Layout(world_size=2, pp=2, virtual_stages=2), {}, "--virtual-stages 2 needs "
         "--schedule interleaved_1f1b"),
        (Layout(world_size=2, pp=2, schedule="interleaved_1f1b", microbatches=3), {},
         "interleaved_1f1b needs --microbatches divisible by --pp 2, got 3: use 2 or 4"),
        (Layout(world_size=2, pp=2, microbatches=3), {"micro_batch": 16}, "--micro-batch 16 "
         "does not split into --microbatches 3 equal pipeline micro-batches: use "
         "--microbatches 2 or 4, or --micro-batch 15 or 18"),
        (Layout(world_size=7), {"global_batch": 1024}, "--global-batch 1024 does not split "
         "over the 7 data-parallel ranks of --world-size 7: use --global-batch 1022 or 1029, "
         "or --world-size 4 or 8"),
        (Layout(world_size=MAX_DEVICES + 1), {}, "--world-size must be an int in "
         "1..1,048,576"),
        (Layout(world_size=2, pp=2, microbatches=5000), {}, "--microbatches must be an int in "
         "1..4,096"),
    ],
)  # fmt: skip
def test_the_layout_check_names_the_fault_and_what_works(layout, batch, expected):
    with pytest.raises(ValueError) as err:
        check_layout(layout, model=TINY, flags=ESTIMATE_FLAGS, **batch)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_valid_layouts_pass():
    for layout in (
        Layout(world_size=8, tp=2, pp=2, dp_replicate=2, sequence_parallel=True),
        Layout(world_size=2, pp=2, schedule="interleaved_1f1b", microbatches=4),
        Layout(world_size=2, pp=2, schedule="zb_h1", microbatches=3),
    ):
        check_layout(layout, model=TINY, micro_batch=12, global_batch=48)
    assert divisors(1 << 30)[-3:] == [1 << 28, 1 << 29, 1 << 30]
    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12]


# The same layout mistake through each of the four commands: one check refuses it in each,
# each in its own flags' words.
SAME_MISTAKE = [
    (["train", "--model", "tiny", "--nproc-per-node", "4", "--pp", "4"],
     "the tiny model's 2 transformer blocks cannot fill 4 pipeline stages (--pp 4)"),
    (["estimate", "--model", "tiny", "--world-size", "4", "--pp", "4"],
     "the tiny model's 2 transformer blocks cannot fill 4 pipeline stages (--pp 4)"),
    (["train", "--model", "tiny", "--sequence-parallel"],
     "--sequence-parallel splits the sequence over tp ranks: add --tp > 1"),
    (["estimate", "--model", "tiny", "--sequence-parallel"],
     "--sequence-parallel splits the sequence over tp ranks: add --tp > 1"),
    (["train", "--model", "tiny", "--pp", "2", "--microbatches", "3"],
     "--micro-batch 8 does not split into --microbatches 3 equal pipeline micro-batches"),
    (["estimate", "--model", "tiny", "--pp", "2", "--microbatches", "3", "--micro-batch", "8"],
     "--micro-batch 8 does not split into --microbatches 3 equal pipeline micro-batches"),
    (["train", "--model", "tiny", "--pp", "2", "--schedule", "interleaved_1f1b",
      "--microbatches", "3", "--micro-batch", "6"],
     "interleaved_1f1b needs --microbatches divisible by --pp 2, got 3: use 2 or 4"),
    (["estimate", "--model", "tiny", "--pp", "2", "--schedule", "interleaved_1f1b",
      "--microbatches", "3", "--micro-batch", "6"],
     "interleaved_1f1b needs --microbatches divisible by --pp 2, got 3: use 2 or 4"),
    (["pipeline", "simulate", "--schedule", "interleaved_1f1b", "--stages", "2",
      "--microbatches", "3"],
     "interleaved_1f1b needs --microbatches divisible by --stages 2, got 3: use 2 or 4"),
    (["plan", "--model", "7b", "--devices", "7"],
     "--global-batch 1024 does not split over the 7 data-parallel ranks of --devices 7: use "
     "--global-batch 1022 or 1029, or --devices 4 or 8"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "expected"), SAME_MISTAKE)
def test_one_layout_check_in_all_four_commands(capsys, tmp_path, argv, expected):
    if argv[0] == "train":
        argv = [*argv, "--run-dir", str(tmp_path / "run")]
    assert expected in _error_line(capsys, *argv)
    assert not (tmp_path / "run").exists()


BAD_INPUT = [
    # plan
    (["plan", "--model", "7b", "--devices", "1000"], "--devices 512 or 1024"),
    (["plan", "--model", "7b", "--devices", "1000000"], "--devices 1024"),
    (["plan", "--model", "7b", "--top", "0"], "--top must be >= 1, got 0"),
    (["plan", "--model", "7b", "--top", "-3"], "--top must be >= 1, got -3"),
    (["plan", "--model", "7b", "--global-batch", "0"], "--global-batch must be a whole number "
     "in 1..1,048,576, got '0'"),
    (["plan", "--model", "7b", "--global-batch", "1e12"], "--global-batch must be a whole "
     "number in 1..1,048,576, got '1e12'"),
    (["plan", "--model", "7b", "--sequences-per-device", "4"], "--sequences-per-device sets a "
     "weak-scaling curve: add --scaling"),
    (["plan", "--model", "7b", "--scaling", "1,2", "--global-batch", "64"], "--global-batch "
     "ranks the plans of one device count"),
    (["plan", "--model", "7b", "--scaling", "a,b"], "--scaling takes comma-separated device "
     "counts, e.g. 1,2,4,8; got 'a,b'"),
    (["plan", "--model", "7b", "--scaling", "1,0"], "--scaling device count must be an int in "
     "1..1,048,576, got 0"),
    (["plan", "--model", "7b", "--devices", "1073741824"], "--devices must be an int in "
     "1..1,048,576, got 1073741824"),
    (["plan", "--model", "7b", "--scaling", "1,1000000000"], "--scaling device count must be "
     "an int in 1..1,048,576, got 1000000000"),
    # pipeline simulate
    (["pipeline", "simulate", "--stages", "4", "--microbatches", "4", "--t-fwd", "0",
      "--t-bwd", "0", "--t-wgrad", "0"], "--t-fwd, --t-bwd and --t-wgrad are all 0"),
    (["pipeline", "simulate", "--stages", "100000", "--microbatches", "100000"],
     "--stages must be an int in 1..1,024, got 100000"),
    (["pipeline", "simulate", "--stages", "200", "--microbatches", "100"],
     "20,000 to simulate, more than 16,384"),
    (["pipeline", "simulate", "--stages", "2", "--microbatches", "5000"],
     "--microbatches must be an int in 1..4,096, got 5000"),
    # estimate
    (["estimate", "--model", "small", "--pp", "2", "--microbatches", "3"],
     "--micro-batch 16 does not split into --microbatches 3"),
    (["estimate", "--params", "7e9", "--tp", "2"], "--tp splits a model's layers: give "
     "--model, not --params"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "expected"), BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, expected):
    assert expected in _error_line(capsys, *argv)


def test_png_must_name_a_png_file(capsys, tmp_path):
    base = ["pipeline", "simulate", "--stages", "2", "--microbatches", "2", "--png"]
    line = _error_line(capsys, *base, str(tmp_path))
    assert f"--png {tmp_path} is a directory: name a file in it, e.g. {tmp_path}/pp.png" in line
    line = _error_line(capsys, *base, str(tmp_path / "chart"))
    assert f"name a file ending in .png, e.g. {tmp_path}/chart.png" in line
    assert main([*base, str(tmp_path / "chart.png")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_simulating_no_compute_is_refused():
    with pytest.raises(ValueError, match="all 0: give at least one a time > 0"):
        simulate("1f1b", 2, 2, t_fwd=0, t_bwd=0, t_wgrad=0)
    # the backward alone still runs: 1F1B's bubble is (p - 1) / m whatever the times
    assert simulate("1f1b", 2, 2, t_fwd=0, t_bwd=0, t_wgrad=1).bubble == Fraction(1, 2)


def test_a_global_batch_that_divides_plans_seven_devices():
    ranked = rank_plans(shape("7b"), 7, hardware("h100x8-ib"), 1029, top=3)
    assert ranked and all(p.plan.dp == 7 and p.plan.global_batch == 1029 for p in ranked)


def test_train_refuses_a_pipeline_stage_without_blocks(capsys, tmp_path):
    line = _error_line(
        capsys, "train", "--model", "tiny", "--nproc-per-node", "4", "--pp", "4",
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert "use --pp <= 2" in line


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("SHARDWISE_DEBUG_COLLECTIVES", "maybe", "it accepts 0/1, true/false, yes/no or on/off"),
        ("SHARDWISE_EMULATE_NODES", "a,b", "it accepts comma-separated node ids >= 0"),
        ("SHARDWISE_EMULATE_LINK", "inter=alpha:3parsecs,bw:1GB/s", "bad alpha '3parsecs'"),
        ("SHARDWISE_EXIT_SAVE_WAIT_S", "-1", "it accepts a number of seconds > 0"),
        ("SHARDWISE_CKPT_CRASH_AT", "later", "it accepts one of before_files, mid_file"),
        ("SHARDWISE_CKPT_CRASH_RANK", "x", "it accepts an int rank >= 0"),
        ("SHARDWISE_CKPT_STALL_S", "nan", "it accepts a number of seconds >= 0"),
        ("SHARDWISE_RESTART_COUNT", "-2", "it accepts an int >= 0"),
    ],
)
def test_junk_in_an_environment_variable_is_one_line(
    capsys, monkeypatch, tmp_path, variable, value, expected
):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    monkeypatch.setenv(variable, value)
    line = _error_line(capsys, "run", "--nproc-per-node", "2", str(script))
    assert line.startswith(f"shardwise run: error: {variable}") and expected in line
    line = _error_line(capsys, "train", "--model", "tiny", "--run-dir", str(tmp_path / "r"))
    assert variable in line and expected in line


def test_junk_in_the_environment_through_the_entry_point(tmp_path):
    script = Path(tmp_path / "hello.py")
    script.write_text("print('hello')\n")
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "run", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "SHARDWISE_EXIT_SAVE_WAIT_S": "soon"},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and "hello" not in out.stdout
    assert out.stderr.strip().splitlines() == [
        "shardwise run: error: SHARDWISE_EXIT_SAVE_WAIT_S='soon': it accepts a number of "
        "seconds > 0 (or unset it)"
    ]

"""``shardwise pipeline simulate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.cli.main import main


def _simulate(args: str) -> int:
    return main(["pipeline", "simulate", *args.split()])


def test_simulate_prints_timeline_bubble_and_peaks(capsys: pytest.CaptureFixture[str]) -> None:
    assert _simulate("--schedule 1f1b --stages 4 --microbatches 8") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rank  0 |F0 F1 F2 F3")
    assert out[3].startswith("rank  3 | .  .  . F0 B0 B0 F1")
    assert "bubble 0.375 of the ideal time (= 3/8)" in out
    assert out[-1].endswith("r0=4, r1=3, r2=2, r3=1")


def test_simulate_interleaved_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "il.png"
    args = f"--schedule interleaved_1f1b --stages 4 --microbatches 8 --virtual-stages 2 --png {png}"
    assert _simulate(args) == 0
    out = capsys.readouterr().out
    assert "(= 3/16)" in out and "r0=5.5" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_zb_h1_with_message_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert _simulate("--schedule zb_h1 --stages 4 --microbatches 8 --t-p2p 1/10") == 0
    out = capsys.readouterr().out
    assert "step time 28.2" in out and "I0 W0" in out


def test_simulate_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    args = "--schedule interleaved_1f1b --stages 4 --microbatches 6 --virtual-stages 2"
    assert _simulate(args) == 2
    assert (
        "needs --microbatches divisible by --stages 4, got 6: use 4 or 8" in capsys.readouterr().err
    )

"""The README's Python examples run as written: every ```python block is saved to a file and
run as a user would, with plain ``python`` or, when its first line says ``# ranks: N``, with
``shardwise run --nproc-per-node N``. Each public subpackage has an example there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
RANKS = re.compile(r"^# ranks: (\d+)")
SUBPACKAGES = (
    "comm",
    "costmodel",
    "data",
    "engine",
    "models",
    "parallel",
    "recompute",
    "sft",
    "topology",
    "zero",
)


def _blocks() -> list[str]:
    return BLOCK.findall((REPO / "README.md").read_text())


def test_every_public_subpackage_has_an_example() -> None:
    text = "\n".join(_blocks())
    missing = [
        s
        for s in SUBPACKAGES
        if not re.search(rf"shardwise\.{s}\b|from shardwise import[^\n]*\b{s}\b", text)
    ]
    assert not missing, f"no README example uses shardwise.{missing}"


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    code = _blocks()[index]
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(code)
    m = RANKS.match(code)
    cmd = [sys.executable, str(script)]
    if m is not None:
        cmd = [sys.executable, "-m", "shardwise.cli.main", "run", "--nproc-per-node", m.group(1)]
        cmd.append(str(script))
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"README example {index} failed:\n{code}\n{done.stderr[-3000:]}"

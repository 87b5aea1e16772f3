"""Which code a benchmark measured: the checkout's commit, marked when ``src/`` has edits."""

from __future__ import annotations

import subprocess
from pathlib import Path


def source_version() -> str:
    """The commit of the checkout this file sits in, ``+dirty`` when ``src/`` has edits."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")

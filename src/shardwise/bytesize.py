"""Byte counts as people write them: parse ``"80GB"``, render ``"1.50 GiB"``, pick an axis unit."""

from __future__ import annotations

import re
from fractions import Fraction

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
BINARY_UNITS: tuple[tuple[int, str], ...] = ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "kib": KiB,
    "mb": 10**6,
    "mib": MiB,
    "gb": 10**9,
    "gib": GiB,
    "tb": 10**12,
    "tib": TiB,
}


def parse_bytes(text: str | int) -> int:
    """Parse a size like ``"80GB"``, ``"1.5 GiB"``, ``"512MiB"`` or ``"4096"`` into bytes.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers
    of 1024; a bare number or ``B`` means bytes. Units are case-insensitive.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"byte size {text} is negative: give a size >= 0")
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        allowed = ", ".join(("B", "KB", "KiB", "MB", "MiB", "GB", "GiB", "TB", "TiB"))
        raise ValueError(f"cannot parse byte size {text!r}: use a number and one of {allowed}")
    return round(Fraction(match.group(1)) * _UNITS[unit])


def byte_unit(num_bytes: float) -> tuple[float, str]:
    """Divisor and name of the largest binary unit not above ``abs(num_bytes)`` (B below 1 KiB)."""
    for div, name in BINARY_UNITS:
        if abs(num_bytes) >= div:
            return float(div), name
    return 1.0, "B"


def format_bytes(num_bytes: float) -> str:
    """Render a byte count with a binary unit, e.g. ``"1.50 GiB"`` (``"512 B"`` below 1 KiB)."""
    div, unit = byte_unit(num_bytes)
    return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes / div:.2f} {unit}"

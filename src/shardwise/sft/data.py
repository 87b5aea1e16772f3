"""Fine-tuning examples from local files: JSONL (one object a line) or a JSON list of objects.

Each example has exactly one of three shapes:

- ``{"text": str}``: plain causal language modelling, loss on every token;
- ``{"prompt": str, "completion": str}``: loss on the completion by default;
- ``{"messages": [{"role": str, "content": str}, ...]}``: rendered with the tokenizer's chat
  template, loss on the assistant turns by default.

A malformed record is an error naming the file, the line (JSONL) or item (JSON) and what is
wrong, or, with ``skip_bad_lines``, skipped and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES = ("text", "prompt + completion", "messages")
"""The record shapes a dataset may hold, in words."""


class DataError(ValueError):
    """A dataset that cannot be used: the message names the file, the record and the fix."""


@dataclass(frozen=True)
class Example:
    """One training example, as read (not yet tokenized)."""

    text: str | None = None
    """Plain text (the ``text`` shape)."""
    prompt: str | None = None
    """The prompt of a ``prompt`` + ``completion`` record."""
    completion: str | None = None
    """Its completion (the part the loss is on by default)."""
    messages: tuple[tuple[str, str], ...] | None = None
    """``(role, content)`` turns of a ``messages`` record."""

    @property
    def kind(self) -> str:
        """``"text"``, ``"prompt"`` or ``"messages"``."""
        if self.messages is not None:
            return "messages"
        return "text" if self.text is not None else "prompt"


@dataclass(frozen=True)
class Dataset:
    """The examples of one file and how many malformed records were skipped."""

    path: Path
    examples: list[Example]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.examples)


def parse_record(record: Any) -> Example:
    """The example a decoded JSON record holds; ``ValueError`` saying what is missing."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    has = [k for k in ("text", "prompt", "completion", "messages") if k in record]
    if has == ["text"]:
        return Example(text=_string(record, "text"))
    if has == ["messages"]:
        return Example(messages=_messages(record["messages"]))
    if has == ["prompt", "completion"]:
        return Example(prompt=_string(record, "prompt"), completion=_string(record, "completion"))
    if has in (["prompt"], ["completion"]):
        other = "completion" if has == ["prompt"] else "prompt"
        raise ValueError(f"has {has[0]!r} but no {other!r}")
    if not has:
        raise ValueError(f"has none of the fields {', '.join(SHAPES)} (keys: {sorted(record)})")
    raise ValueError(f"mixes the fields {has}: use exactly one of {', '.join(SHAPES)}")


def _string(record: dict[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    return value


def _messages(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    turns = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] has no string 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] has no string 'content'")
        turns.append((m["role"], m["content"]))
    if not any(role == "assistant" for role, _ in turns):
        raise ValueError("'messages' has no assistant turn: nothing to learn from")
    return tuple(turns)


def _records(path: Path) -> list[tuple[str, Any | ValueError]]:
    """``(where, decoded record or the error decoding it)`` for every record of ``path``."""
    if path.suffix == ".parquet":
        raise DataError(
            f"{path}: Parquet needs pyarrow, which shardwise does not depend on: convert it to "
            "JSONL (one JSON object a line)"
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if path.suffix == ".json":
        try:
            items = json.loads(raw)
        except ValueError as exc:
            raise DataError(f"{path} is not valid JSON ({exc}): fix it or use JSONL") from exc
        if not isinstance(items, list):
            raise DataError(f"{path} must hold a JSON list of objects")
        return [(f"item {i}", item) for i, item in enumerate(items)]
    out: list[tuple[str, Any | ValueError]] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"line {number}", json.loads(line)))
        except ValueError as exc:
            out.append((f"line {number}", ValueError(f"is not valid JSON ({exc.args[0]})")))
    return out


def read_dataset(path: Path | str, *, skip_bad_lines: bool = False) -> Dataset:
    """Read and check every record of ``path`` (``.jsonl``, ``.json``; ``.parquet`` is refused
    with what to do). Raises ``DataError`` naming the file, record and problem (the first bad
    record, unless ``skip_bad_lines``) or saying the file holds no example."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist: pass a .jsonl or .json file")
    examples: list[Example] = []
    skipped = 0
    for where, record in _records(path):
        try:
            if isinstance(record, ValueError):
                raise record
            examples.append(parse_record(record))
        except ValueError as exc:
            if not skip_bad_lines:
                raise DataError(
                    f"{path}:{where.split()[-1]}: {where} {exc} (pass --skip-bad-lines to skip "
                    "malformed records)"
                ) from None
            skipped += 1
    if not examples:
        extra = f" ({skipped} malformed records skipped)" if skipped else ""
        raise DataError(f"{path} holds no example{extra}: each record needs {', '.join(SHAPES)}")
    return Dataset(path, examples, skipped)

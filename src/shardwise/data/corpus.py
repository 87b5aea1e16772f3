"""Byte-level text corpora: load documents, split them into train and validation tokens.

Tokens are the raw UTF-8 bytes of each document (vocabulary of 256), so no tokenizer is needed.
The default corpus is the running Python's standard library source, which every machine with
Python has.
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256
"""Byte-level vocabulary: one token per byte value."""

VAL_FRACTION = 0.05
"""Share of documents (or of bytes, for a single document) held out for validation."""

_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams of one corpus.

    Documents are concatenated in sorted path order; a document is wholly in one split.
    """

    name: str
    """Where the text came from (a path, or ``stdlib:<dir>``)."""
    train: torch.Tensor
    """uint8 [train_tokens]: training bytes."""
    val: torch.Tensor
    """uint8 [val_tokens]: validation bytes, disjoint from ``train``."""
    num_docs: int
    """Documents read (train and validation together)."""
    vocab_size: int = VOCAB_SIZE
    """Number of distinct token ids."""

    def unigram_entropy(self) -> float:
        """Cross-entropy in nats/token of a unigram model fit on ``train``, evaluated on ``val``.

        Counts get add-one smoothing so unseen bytes have finite cost. A language model must get
        its validation loss below this to have learned more than byte frequencies.
        """
        counts = torch.bincount(self.train.long(), minlength=self.vocab_size).double() + 1.0
        log_probs = torch.log(counts / counts.sum())
        val_counts = torch.bincount(self.val.long(), minlength=self.vocab_size).double()
        return float(-(val_counts * log_probs).sum() / val_counts.sum())

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """Tokens (int64 [len]) for ``text``: its UTF-8 bytes."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    @staticmethod
    def decode(tokens: torch.Tensor) -> str:
        """Text for ``tokens`` (1-D); invalid UTF-8 sequences become U+FFFD."""
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def _stdlib_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def _tree_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise_walk_error):
        # Hidden entries (.git, .cache, ...) are tooling, not text.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    return sorted(files)


def _raise_walk_error(err: OSError) -> None:
    raise ValueError(f"cannot read corpus directory {err.filename}: {err.strerror}") from err


def _read_text_bytes(path: Path) -> bytes | None:
    """The file's bytes if it is UTF-8 text, None for binary or undecodable content."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read corpus file {path}: {err.strerror or err}") from err
    if b"\x00" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _is_val(rel_path: str, val_fraction: float) -> bool:
    # crc32 of the relative path is stable across runs, machines and Python's hash seed; the
    # path's bytes as the filesystem has them (a name need not be UTF-8)
    return zlib.crc32(os.fsencode(rel_path)) % 10_000 < val_fraction * 10_000


def _split(docs: list[tuple[str, bytes]], val_fraction: float) -> tuple[bytes, bytes]:
    train = [data for rel, data in docs if not _is_val(rel, val_fraction)]
    val = [data for rel, data in docs if _is_val(rel, val_fraction)]
    if train and val:
        return b"".join(train), b"".join(val)
    # Too few documents to split by document: hold out the tail of the concatenation instead.
    text = b"".join(data for _, data in docs)
    cut = len(text) - max(1, math.floor(len(text) * val_fraction))
    return text[:cut], text[cut:]


def load_corpus(
    path: str | None = None,
    *,
    max_bytes: int | None = None,
    val_fraction: float = VAL_FRACTION,
) -> Corpus:
    """Load a byte-level corpus and split it into train and validation tokens.

    Args:
        path: A UTF-8 text file, or a directory read recursively (sorted, hidden entries,
            binary and non-UTF-8 files skipped). None reads the ``.py`` files of the running
            Python's standard library (without site-packages and test directories).
        max_bytes: Stop after this many bytes (documents in sorted order, the last one cut).
        val_fraction: Share of documents, chosen by a stable hash of their relative path, held
            out for validation; with too few documents, the share of trailing bytes instead.

    Raises:
        ValueError: The path is missing or unreadable, or holds no text.
    """
    if max_bytes is not None and max_bytes < 2:
        raise ValueError(f"max_bytes={max_bytes}: set it to at least 2 (one train, one val byte)")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: set it strictly between 0 and 1")
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        name, files = f"stdlib:{root}", _stdlib_files(root)
    else:
        root = Path(path)
        name = str(root)
        if not root.exists():
            raise ValueError(f"corpus path {path!r} does not exist: pass a text file or directory")
        files = _tree_files(root) if root.is_dir() else [root]
    docs: list[tuple[str, bytes]] = []
    total = 0
    for file in files:
        data = _read_text_bytes(file)
        if data is None:
            logger.debug("skipping non-UTF-8 file %s", file)
            continue
        if not data:
            continue
        if max_bytes is not None:
            data = data[: max_bytes - total]
        rel = file.relative_to(root).as_posix() if file != root else file.name
        docs.append((rel, data))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if total < 2:
        raise ValueError(
            f"corpus at {name!r} has {total} bytes of UTF-8 text ({len(files)} file(s) read; "
            "empty, binary and non-UTF-8 files are skipped): point --data at text files"
        )
    train, val = _split(docs, val_fraction)
    logger.info(
        "corpus %s: %d docs, %d train / %d val bytes", name, len(docs), len(train), len(val)
    )
    return Corpus(
        name=name,
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        num_docs=len(docs),
    )


def check_corpus_fits(corpus: Corpus, seq_len: int) -> None:
    """Raise ``ValueError`` unless both splits hold at least one sequence of ``seq_len`` tokens
    plus its target (what the batch sampler needs)."""
    need = seq_len + 1
    for split, tokens in (("training", corpus.train), ("validation", corpus.val)):
        if tokens.numel() < need:
            total = corpus.train.numel() + corpus.val.numel()
            raise ValueError(
                f"corpus at {corpus.name!r} is too small: its {split} split has "
                f"{tokens.numel()} bytes, and a sequence needs {need} ({total} bytes in all; "
                f"{VAL_FRACTION:.0%} go to validation): add text or lower --seq-len"
            )

"""What a ``shardwise train`` run does: its options, validated, and the resolved run config.

``TrainOptions`` holds the knobs of the training loop (model preset, steps, learning rate, data,
evaluation); ``RunConfig`` joins them with the engine's ``shardwise.Config``, the model shape
and the world size, and is what ``config.json`` in the run directory stores. The launcher builds
and validates it before any rank starts; every rank reads it back from that file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.config import Config
from shardwise.costmodel.memory import gpt_params_per_rank
from shardwise.models.gpt import MODEL_SIZES, GPTConfig
from shardwise.parallel.context.attention import METHODS as CP_METHODS

DEFAULT_STEPS = 600
"""Optimizer steps of the default run (2-4 minutes at 2 ranks on 2 CPU cores)."""


@dataclass(kw_only=True)
class TrainOptions:
    """Knobs of the training loop. Each field documents its unit."""

    model: str = "small"
    """Model preset, a key of ``shardwise.models.MODEL_SIZES``."""
    steps: int = DEFAULT_STEPS
    """Optimizer steps to train in total (a resumed run continues up to this many)."""
    seq_len: int | None = None
    """Tokens per training sequence (None: the preset's context length)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW, reached after the warmup."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``lr * min_lr_ratio`` on the last step."""
    warmup_steps: int | None = None
    """Steps of linear warmup (None: 10% of ``steps``, at most 100)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (biases, norms and embeddings: none)."""
    eval_every: int = 50
    """Compute the validation loss every this many steps, and after the last one (0: only then)."""
    eval_batches: int = 4
    """Validation micro-batches each rank evaluates per evaluation."""
    log_every: int = 10
    """Steps between progress lines when the output is not a terminal."""
    data: str | None = None
    """Text file or directory to train on (None: the Python standard library's sources)."""
    max_bytes: int | None = None
    """Read at most this many bytes of the corpus (None: all of it)."""
    tp: int = 1
    """Tensor-parallel degree: ranks splitting each layer (the mesh's tp axis)."""
    sequence_parallel: bool = False
    """Under tensor parallelism, run norms and dropout on 1/tp of the sequence."""
    pp: int = 1
    """Pipeline-parallel degree: stages the model's layers are split into (the mesh's pp axis)."""
    cp: int = 1
    """Context-parallel degree: ranks splitting each sequence (the mesh's cp axis)."""
    cp_method: str = "ring"
    """Context-parallel attention: ``ring`` (K/V around the cp ring) or ``all_to_all``
    (heads over cp; the heads per tp rank must divide by cp)."""
    dp_replicate: int = 1
    """Hierarchical sharding (HSDP): the dp ranks form this many replicas, each sharding the
    model states over its own dp / dp_replicate consecutive ranks (one node, launched so); 1:
    ZeRO shards over all dp ranks."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option to change."""
        if self.model not in MODEL_SIZES:
            raise ValueError(
                f"--model {self.model!r} is unknown: choose one of {', '.join(MODEL_SIZES)}"
            )
        for name in ("steps", "eval_batches", "log_every", "tp", "pp", "cp", "dp_replicate"):
            _at_least(name, getattr(self, name), 1)
        _at_least("eval_every", self.eval_every, 0)
        if self.cp_method not in CP_METHODS:
            raise ValueError(
                f"--cp-method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}"
            )
        if self.seq_len is not None:
            _at_least("seq_len", self.seq_len, 2)
        if self.warmup_steps is not None:
            _at_least("warmup_steps", self.warmup_steps, 0)
        if self.max_bytes is not None:
            _at_least("max_bytes", self.max_bytes, 1024)
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise ValueError(f"--lr must be a number in (0, 1), got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.data is not None and not Path(self.data).exists():
            raise ValueError(
                f"--data path {self.data!r} does not exist: pass a text file or "
                "directory, or leave --data out to use the Python standard library"
            )

    @property
    def warmup(self) -> int:
        """Resolved warmup length in steps."""
        if self.warmup_steps is not None:
            return min(self.warmup_steps, self.steps)
        return min(100, max(1, self.steps // 10))

    def model_config(self) -> GPTConfig:
        """The model shape: the preset with ``seq_len`` applied."""
        cfg = GPTConfig.named(self.model)
        return cfg if self.seq_len is None else dataclasses.replace(cfg, seq_len=self.seq_len)


def _at_least(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} must be an int >= {minimum}, got {value!r}")


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs, as stored in ``config.json``."""

    train: TrainOptions
    """The training loop's options."""
    engine: Config
    """The engine's resolved configuration."""
    world_size: int
    """Ranks the run was launched with."""
    launch: dict[str, Any] = field(default_factory=dict)
    """Launcher options (ranks per node, nodes), for the record."""
    finetune: dict[str, Any] | None = None
    """A ``shardwise finetune`` run's options (``shardwise.sft.options.FinetuneOptions``
    as a dict); None: a ``shardwise train`` run of the built-in GPT."""

    def __post_init__(self) -> None:
        if self.engine.micro_batch_size is None:
            raise ValueError("the engine config needs micro_batch_size for a training run")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")

    @property
    def model(self) -> GPTConfig:
        return self.train.model_config()

    @property
    def micro_batch(self) -> int:
        assert self.engine.micro_batch_size is not None  # checked in __post_init__
        return self.engine.micro_batch_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the ranks over ``tp x pp x cp``; each reads its own batches
        (a batch's cp ranks read the same one, each keeping 1/cp of every sequence)."""
        return self.world_size // (self.train.tp * self.train.pp * self.train.cp)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks (each dp replica reads its own)."""
        return self.micro_batch * self.engine.gradient_accumulation_steps * self.dp_size

    @property
    def tokens_per_step(self) -> int:
        """Training tokens per optimizer step over all ranks."""
        return self.global_batch_size * self.model.seq_len

    def layout(self) -> str:
        """The mesh in words, e.g. ``dp2 x tp2`` (axes of size 1 left out unless all are)."""
        r = self.train.dp_replicate
        dp = f"dp{self.dp_size}" + (f" ({r} replicas of {self.dp_size // r})" if r > 1 else "")
        sizes = (
            ("pp", self.train.pp),
            ("dp", self.dp_size),
            ("cp", self.train.cp),
            ("tp", self.train.tp),
        )
        named = [dp if axis == "dp" else f"{axis}{size}" for axis, size in sizes if size > 1]
        return " x ".join(named) if named else "dp1"

    def params_per_rank(self) -> int:
        """Parameter elements one rank holds before ZeRO shards them over dp: the whole model,
        or under tensor parallelism its tp shard (``shardwise.costmodel.memory``)."""
        if self.train.tp == 1:
            return self.model.param_count()
        return sum(gpt_params_per_rank(self.model, self.train.tp))

    def derived(self) -> dict[str, Any]:
        """Values computed from the options, stored for readers of ``config.json``."""
        if self.finetune is not None:  # the model is the directory's, its size known on ranks
            return {
                "global_batch_size": self.global_batch_size,
                "dp_size": self.dp_size,
                "warmup_steps": self.train.warmup,
            }
        cfg = self.model
        return {
            "global_batch_size": self.global_batch_size,
            "dp_size": self.dp_size,
            "tokens_per_step": self.tokens_per_step,
            "total_tokens": self.tokens_per_step * self.train.steps,
            "num_params": cfg.param_count(),
            "seq_len": cfg.seq_len,
            "warmup_steps": self.train.warmup,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "train": dataclasses.asdict(self.train),
            "shardwise": self.engine.to_dict(),
            "model": dataclasses.asdict(self.model),
            "world_size": self.world_size,
            "launch": dict(self.launch),
            **({"finetune": dict(self.finetune)} if self.finetune is not None else {}),
            "derived": self.derived(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Inverse of ``to_dict`` (``model`` and ``derived`` are recomputed, not read)."""
        try:
            return cls(
                train=TrainOptions(**data["train"]),
                engine=Config.from_dict(data["shardwise"]),
                world_size=int(data["world_size"]),
                launch=dict(data.get("launch", {})),
                finetune=data.get("finetune"),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"run config is missing or has a bad entry: {exc}") from exc

    def write(self, path: Path) -> None:
        """Write ``config.json`` (to a temp name, then renamed into place)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> RunConfig:
        if not path.is_file():
            raise ValueError(f"{path} does not exist: is this a shardwise train run directory?")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"{path} is not valid JSON ({exc}): restore it or start a new run"
            ) from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object: restore it or start a new run")
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

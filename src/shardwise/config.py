"""``shardwise.Config``: one typed, validated configuration for a training run.

Flat for the common knobs (``Config(zero_stage=3, precision="bf16")``); loaded from a dict or a
JSON / TOML / YAML file; unknown keys and bad values raise ``ValueError`` naming the key, the
allowed values and, for a near-miss spelling, the key that was probably meant.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shardwise.bytesize import MiB
from shardwise.comm.algorithms import ALGORITHMS
from shardwise.precision import PRECISIONS

REDUCE_DTYPES = (None, *PRECISIONS)
RESUME = ("never", "auto")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
COUNT_MAX = 2**31 - 1
"""Upper bound of every count (steps, sizes in items): larger is a typo, not a plan."""

RANGES: dict[str, tuple[int, int]] = {
    "micro_batch_size": (1, COUNT_MAX),
    "gradient_accumulation_steps": (1, COUNT_MAX),
    "reduce_bucket_bytes": (1, 1 << 40),
    "prefetch_units": (0, 1024),
    "seed": (0, 2**63 - 1),
    "initial_loss_scale_power": (0, 63),
    "loss_scale_window": (1, COUNT_MAX),
    "checkpoint_every": (0, COUNT_MAX),
    "keep_last": (1, COUNT_MAX),
    "pipeline_microbatches": (1, COUNT_MAX),
    "pipeline_virtual_stages": (1, 1024),
}
"""Allowed [low, high] of the int fields (None, where a field allows it, is not checked)."""


@dataclass(kw_only=True)
class Config:
    """Everything that shapes a training run. Each field documents its unit."""

    zero_stage: int = 0
    """ZeRO stage: 0 data parallel, 1 shard optimizer states, 2 also gradients, 3 also params."""
    micro_batch_size: int | None = None
    """Sequences per rank per micro-step (for the derived global batch; None: not tracked)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step."""
    gradient_clipping: float | None = None
    """Clip gradients to this global L2 norm (None: no clipping)."""
    reduce_bucket_bytes: int = 16 * MiB
    """Stages 0-2: gradient bucket size in bytes (one collective per bucket)."""
    prefetch_units: int = 1
    """Stage 3: how many units ahead to all-gather parameters while computing."""
    wrap_policy: list[str] | None = None
    """Stage 3: module class names that form units (None: each direct child with parameters)."""
    seed: int = 0
    """Seed of the run's RNGs: ``shardwise train`` seeds python, numpy and torch with it
    (``shardwise.seed_all``) and a resumed checkpoint at another world size reseeds from it; the
    engine itself never seeds."""
    precision: str = "fp32"
    """Compute dtype of parameters and activations: fp32, bf16 or fp16."""
    reduce_dtype: str | None = None
    """Dtype gradients are reduced in (None: fp32)."""
    allreduce_algorithm: str = "native"
    """Stage 0 gradient all_reduce: native, ring, halving_doubling, tree, hierarchical or auto."""
    initial_loss_scale_power: int = 16
    """fp16: the dynamic loss scale starts at 2**this."""
    loss_scale_window: int = 1000
    """fp16: double the loss scale after this many steps without overflow."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never goes below this."""
    activation_checkpointing: list[str] | None = None
    """Module class names whose activations are recomputed in backward (e.g. ["Block"])."""
    offload_optimizer: bool = False
    """Keep fp32 master weights and optimizer states in host memory; step on the CPU."""
    allow_untested_optimizer: bool = False
    """Accept an optimizer class shardwise does not know to be element-wise."""
    checkpoint_dir: str | None = None
    """Directory for sharded checkpoints (None: no automatic checkpoints)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many optimizer steps (0: never automatically)."""
    keep_last: int | None = 3
    """Keep this many committed checkpoints (None: keep all)."""
    checkpoint_frozen: bool = True
    """Save frozen (requires_grad=False) parameters in checkpoints; False: only trainable ones
    (and their optimizer states), and a load keeps the frozen parameters' current values, so
    give them first (``initialize(weights=...)``: the base of a LoRA model)."""
    async_save: bool = False
    """Write checkpoints from a background thread while training continues."""
    resume: str = "never"
    """"auto": resume from the newest verified checkpoint in checkpoint_dir; "never"."""
    debug_collectives: bool = False
    """Check before each collective that every rank issues the same call (slower)."""
    nonfinite_grads: str = "skip"
    """fp32/bf16, a non-finite global gradient norm: "skip" the step with a warning, or "raise"."""
    pipeline_schedule: str = "1f1b"
    """A PipelineModule's schedule: gpipe, 1f1b, interleaved_1f1b or zb_h1."""
    pipeline_microbatches: int = 1
    """A PipelineModule: micro-batches per accumulation step of ``train_batch``."""
    pipeline_virtual_stages: int | None = None
    """A PipelineModule: stages per pp rank (more than 1 for interleaved_1f1b); None: the
    PipelineModule's own (``virtual_stages``, where it is stated once)."""
    pipeline_zero3_regather: bool = False
    """A PipelineModule at ZeRO-3: all_gather a stage's parameters once per step and keep them
    until the step ends (False), or for each micro-batch's forward and again for its backward,
    freed between micro-batches (True: 2m times the gathers for the same peak, since a
    backward holds the stage's units until it ends; ``benchmarks/pipeline_zero3.py``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form values for the user's own scripts (not read by shardwise)."""

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_dir, os.PathLike):
            self.checkpoint_dir = os.fspath(self.checkpoint_dir)
        self.validate()

    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first field of a wrong type or out of
        its range, and what it allows."""
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), _hints()[f.name])
        for name, (low, high) in RANGES.items():
            _check_range(name, getattr(self, name), low, high)
        _choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        _choice("precision", self.precision, PRECISIONS)
        _choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        _choice("resume", self.resume, RESUME)
        _choice("nonfinite_grads", self.nonfinite_grads, ("skip", "raise"))
        _choice("allreduce_algorithm", self.allreduce_algorithm, ALGORITHMS)
        _choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        if self.allreduce_algorithm != "native" and self.zero_stage > 0:
            raise ValueError(
                f"allreduce_algorithm={self.allreduce_algorithm!r} applies to zero_stage=0 "
                "(stages 1-3 reduce_scatter their gradients); use 'native' or zero_stage=0"
            )
        _positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)
        _positive_int("reduce_bucket_bytes", self.reduce_bucket_bytes)
        _positive_int("loss_scale_window", self.loss_scale_window)
        if self.micro_batch_size is not None:
            _positive_int("micro_batch_size", self.micro_batch_size)
        if not isinstance(self.prefetch_units, int) or self.prefetch_units < 0:
            raise ValueError(f"prefetch_units must be an int >= 0, got {self.prefetch_units!r}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an int >= 0, got {self.checkpoint_every!r}")
        if self.keep_last is not None:
            _positive_int("keep_last", self.keep_last)
        if self.gradient_clipping is not None and not (
            math.isfinite(self.gradient_clipping) and self.gradient_clipping > 0
        ):
            raise ValueError(
                f"gradient_clipping must be a number > 0 or None, got {self.gradient_clipping!r}"
            )
        if not (0 < self.min_loss_scale <= 2.0**self.initial_loss_scale_power):
            raise ValueError(
                f"min_loss_scale must be > 0 and at most the initial loss scale "
                f"2**{self.initial_loss_scale_power}, got {self.min_loss_scale!r}"
            )
        for name in ("wrap_policy", "activation_checkpointing"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, str) or not all(isinstance(v, str) for v in value)
            ):
                raise ValueError(f"{name} must be a list of module class names, got {value!r}")
        if self.resume == "auto" and not self.checkpoint_dir:
            raise ValueError('resume="auto" needs checkpoint_dir to be set')
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir to be set")

    # ---- construction ----

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        """Build from a dict; an unknown key is an error that suggests the closest known key."""
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"unknown config key {key!r}{hint} Known keys: {', '.join(sorted(known))}"
                )
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Load a .json, .toml or .yaml/.yml file."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} does not exist")
        suffix = p.suffix.lower()
        if suffix not in (".json", ".toml", ".yaml", ".yml"):
            raise ValueError(f"config file {p} must end in .json, .toml, .yaml or .yml")
        try:
            data = _parse(p.read_text(encoding="utf-8"), suffix)
        except (ValueError, UnicodeDecodeError) as exc:
            detail = " ".join(str(exc).split())  # one line: parsers report over several
            raise ValueError(
                f"config file {p} is not valid {suffix[1:].upper()}: {detail}"
            ) from exc
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a mapping of keys to values")
        try:
            return cls.from_dict(data)
        except ConfigTypeError as exc:
            raise ConfigTypeError(f"config file {p}: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"config file {p}: {exc}") from exc

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- derived values ----

    def global_batch_size(self, dp_size: int) -> int | None:
        """Sequences per optimizer step: micro-batch x accumulation x data-parallel size."""
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.gradient_accumulation_steps * dp_size

    def dump(self, dp_size: int = 1) -> str:
        """The resolved configuration with derived values, one key per line."""
        lines = [f"{k} = {v!r}" for k, v in self.to_dict().items()]
        gb = self.global_batch_size(dp_size)
        lines.append(f"# dp_size = {dp_size}")
        if gb is not None:
            lines.append(
                f"# global_batch_size = {self.micro_batch_size} x "
                f"{self.gradient_accumulation_steps} x {dp_size} = {gb}"
            )
        return "\n".join(lines)


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _parse(text: str, suffix: str) -> Any:
    """The mapping in a config file's text; ``ValueError`` on a syntax error."""
    if suffix == ".json":
        return json.loads(text)
    if suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    import yaml

    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from exc


class ConfigTypeError(TypeError, ValueError):
    """A config value of the wrong type (a ``ValueError`` too, so one ``except`` catches every
    bad value)."""


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _is_a(value: Any, kind: Any) -> bool:
    """``isinstance`` for the annotations Config uses; a bool is never an int or a float."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return True
    if kind is type(None):
        return value is None
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if origin is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(_is_a(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return isinstance(value, kind)


def _describe(kind: Any) -> str:
    names = {
        int: "an int",
        float: "a finite number",
        bool: "true or false (a bool, not a string)",
        str: "a string",
        type(None): "None",
    }
    if typing.get_origin(kind) is list:
        return "a list of module class names (strings)"
    if typing.get_origin(kind) is dict:
        return "a mapping with string keys"
    return names.get(kind, getattr(kind, "__name__", str(kind)))


def _check_type(name: str, value: Any, hint: Any) -> None:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = typing.get_args(hint) if union else (hint,)
    if any(_is_a(value, k) for k in kinds):
        return
    allowed = " or ".join(_describe(k) for k in kinds)
    raise ConfigTypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")


def _check_range(name: str, value: Any, low: int, high: int) -> None:
    if value is None or low <= value <= high:
        return
    if high == COUNT_MAX:
        bound = f">= {low}" if value < low else f"<= {high} (2**31 - 1)"
    else:
        bound = f"in {low}..{high}"
    raise ValueError(f"{name} must be an int {bound}, got {value!r}")

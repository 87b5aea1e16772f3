"""One validation of a parallel layout, shared by ``shardwise plan``, ``estimate``,
``pipeline simulate`` and ``train``: what one of them accepts, the others accept too.

A layout is dp x cp x tp x pp ranks (dp split into ``dp_replicate`` replicas under HSDP), an
optional pipeline schedule with its micro-batches and virtual stages, and sequence
parallelism. ``check_layout`` refuses one the ranks, the model or the batch cannot split
evenly, with one line naming the flag at fault and the nearest values that would work. Each
command names its flags in a ``Flags`` (``--devices`` for ``plan``, ``--stages`` for
``simulate``, ...), so the line speaks the command's language.

Upper bounds keep every command answering within seconds: ``MAX_DEVICES`` ranks,
``MAX_STAGES`` pipeline stages (pp x virtual stages), ``MAX_MICROBATCHES`` micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.models.gpt import GPTConfig
from shardwise.parallel.context.attention import METHODS as CP_METHODS
from shardwise.parallel.pipeline.schedule import SCHEDULES

MAX_DEVICES = 1 << 20
"""Most ranks (devices) a layout may have: 1,048,576, beyond any machine built."""
MAX_STAGES = 1024
"""Most pipeline stages (pp x virtual stages)."""
MAX_MICROBATCHES = 4096
"""Most pipeline micro-batches per step."""
MAX_VIRTUAL_STAGES = 1024
"""Most model chunks per pipeline rank (interleaved 1F1B)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How ``world_size`` ranks split: ``pp`` pipeline stages of ``tp`` tensor-parallel ranks,
    the rest data parallel."""

    world_size: int
    """Ranks (devices) in all."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (pipeline ranks)."""
    cp: int = 1
    """Context-parallel degree: ranks splitting each sequence."""
    cp_method: str = "ring"
    """Context-parallel attention, ``ring`` or ``all_to_all`` (heads split over cp)."""
    dp_replicate: int = 1
    """HSDP: replicas the dp ranks form (1: ZeRO shards over all of them)."""
    sequence_parallel: bool = False
    """Norms and dropout on 1/tp of the sequence (needs tp > 1)."""
    schedule: str | None = None
    """Pipeline schedule, one of ``shardwise.parallel.pipeline.schedule.SCHEDULES`` (None: 1f1b)."""
    microbatches: int | None = None
    """Pipeline micro-batches per step (None: not given; pp under a pipeline)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B)."""

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches a pipeline step runs: as given, else pp."""
        return self.pp if self.microbatches is None else self.microbatches

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the world over tp x pp x cp."""
        return self.world_size // (self.tp * self.pp * self.cp)


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """What of a model's shape a layout must split evenly."""

    name: str
    """How the model is named in messages (``tiny``, ``7b``)."""
    n_layer: int
    """Transformer blocks: every pipeline stage needs one."""
    n_head: int
    """Attention heads: tp must divide them."""
    d_model: int
    """Width: tp must divide it."""
    seq_len: int
    """Tokens per sequence: tp must divide it under sequence parallelism."""


@dataclass(frozen=True, kw_only=True)
class Flags:
    """How a command spells each part of a layout in its messages. ``world`` is a flag, or a
    phrase with ``{n}`` for the count (``train``: the ranks of ``--nproc-per-node x
    --nnodes``)."""

    world: str = "the {n} ranks (--nproc-per-node x --nnodes)"
    tp: str = "--tp"
    pp: str = "--pp"
    cp: str = "--cp"
    cp_method: str = "--cp-method"
    dp_replicate: str = "--dp-replicate"
    sequence_parallel: str = "--sequence-parallel"
    schedule: str = "--schedule"
    microbatches: str = "--microbatches"
    virtual_stages: str = "--virtual-stages"
    micro_batch: str = "--micro-batch"
    global_batch: str = "--global-batch"
    seq_len: str = "--seq-len"

    def world_is(self, n: int | str) -> str:
        """``the 3 ranks (...)`` or ``--devices 3``."""
        return self.world.format(n=n) if "{n}" in self.world else f"{self.world} {n}"


def gpt_dims(name: str, cfg: GPTConfig, seq_len: int | None = None) -> ModelDims:
    """The dims of the built-in GPT ``cfg`` (preset ``name``), at ``seq_len`` if given."""
    return ModelDims(
        name=name,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        d_model=cfg.d_model,
        seq_len=cfg.seq_len if seq_len is None else seq_len,
    )


TRAIN_FLAGS = Flags()
ESTIMATE_FLAGS = Flags(world="--world-size")
PLAN_FLAGS = Flags(world="--devices", tp="tp", pp="pp")
SIMULATE_FLAGS = Flags(world="--stages", pp="--stages")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending (O(sqrt n))."""
    low = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted({*low, *(n // k for k in low)})


def _near(candidates: list[int], x: int) -> list[int]:
    """The candidates nearest below and above ``x`` (one or two of them, ascending)."""
    below = [c for c in candidates if c < x]
    above = [c for c in candidates if c > x]
    return [*below[-1:], *above[:1]]


def _multiples(k: int, x: int) -> list[int]:
    """The multiples of ``k`` nearest below and above ``x`` (>= k)."""
    lo, hi = (x // k) * k, -(-x // k) * k
    return sorted({m for m in (lo, hi) if m >= k})


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def check_layout(
    layout: Layout,
    *,
    model: ModelDims | None = None,
    micro_batch: int | None = None,
    global_batch: int | None = None,
    flags: Flags = TRAIN_FLAGS,
    single_stage_ok: bool = False,
) -> None:
    """Raise ``ValueError`` with one line naming what ``layout`` cannot split and the nearest
    values that would.

    Args:
        layout: the degrees to check.
        model: the model they split (None: only the ranks are checked).
        micro_batch: sequences per rank per micro-step, split into ``layout.microbatches``
            pipeline micro-batches (None: not checked).
        global_batch: sequences per step, split over the dp ranks (None: not checked).
        flags: how the command names each part.
        single_stage_ok: a pipeline of one stage is a layout (``pipeline simulate``); else
            pipeline options need pp > 1.
    """
    _check_counts(layout, flags)
    _check_ranks(layout, flags)
    _check_pipeline(layout, flags, single_stage_ok)
    if model is not None:
        _check_model(layout, model, flags)
    if micro_batch is not None:
        _check_micro_batch(layout, micro_batch, flags)
    if global_batch is not None:
        _check_global_batch(layout, global_batch, flags)


def _check_counts(layout: Layout, flags: Flags) -> None:
    m = 1 if layout.microbatches is None else layout.microbatches
    for flag, value, high in (
        (flags.pp, layout.pp, MAX_STAGES),
        (flags.world, layout.world_size, MAX_DEVICES),
        (flags.tp, layout.tp, MAX_DEVICES),
        (flags.cp, layout.cp, MAX_DEVICES),
        (flags.dp_replicate, layout.dp_replicate, MAX_DEVICES),
        (flags.virtual_stages, layout.virtual_stages, MAX_VIRTUAL_STAGES),
        (flags.microbatches, m, MAX_MICROBATCHES),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            name = flag.format(n="").split("(")[-1].rstrip(")") if "{n}" in flag else flag
            raise ValueError(f"{name} must be an int in 1..{high:,}, got {value!r}")
    stages = layout.pp * layout.virtual_stages
    if stages > MAX_STAGES:
        raise ValueError(
            f"{flags.pp} {layout.pp} x {flags.virtual_stages} {layout.virtual_stages} = "
            f"{stages:,} pipeline stages, more than {MAX_STAGES:,}: lower either"
        )


def _check_ranks(layout: Layout, flags: Flags) -> None:
    tp, pp, cp, world = layout.tp, layout.pp, layout.cp, layout.world_size
    if world % (tp * pp * cp):
        degrees = [(flags.tp, tp), (flags.pp, pp), (flags.cp, cp)]
        named = [f"{flag} {k}" for flag, k in degrees if k > 1] or [f"{flags.tp} {tp}"]
        what = " x ".join(named)
        worlds = _either(_multiples(tp * pp * cp, world))
        raise ValueError(
            f"{what} does not divide {flags.world_is(world)}: use {flags.world_is(worlds)}, "
            f"or degrees whose product divides {world} ({_either(divisors(world)[:8])})"
        )
    if layout.sequence_parallel and tp == 1:
        raise ValueError(
            f"{flags.sequence_parallel} splits the sequence over tp ranks: add {flags.tp} > 1"
        )
    r, dp = layout.dp_replicate, layout.dp
    if dp % r:
        raise ValueError(
            f"{flags.dp_replicate} {r} does not divide the {dp} data-parallel ranks: use "
            f"{_either(_near(divisors(dp), r))} (e.g. the number of nodes)"
        )


def _check_pipeline(layout: Layout, flags: Flags, single_stage_ok: bool) -> None:
    pp, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    schedule = layout.schedule or "1f1b"
    if pp == 1 and not single_stage_ok:
        for flag, given in (
            (flags.schedule, schedule != "1f1b"),
            (flags.microbatches, m not in (None, 1)),
            (flags.virtual_stages, v != 1),
        ):
            if given:
                raise ValueError(f"{flag} describes a pipeline: add {flags.pp} > 1, or drop it")
        return
    if schedule not in SCHEDULES:
        raise ValueError(
            f"{flags.schedule} must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
        )
    if v != 1 and schedule != "interleaved_1f1b":
        raise ValueError(
            f"{flags.virtual_stages} {v} needs {flags.schedule} interleaved_1f1b ({schedule} "
            "runs one stage per rank)"
        )
    m = layout.pipeline_microbatches
    if schedule == "interleaved_1f1b" and m % pp:
        raise ValueError(
            f"interleaved_1f1b needs {flags.microbatches} divisible by {flags.pp} {pp}, got "
            f"{m}: use {_either(_multiples(pp, m))}"
        )


def _check_model(layout: Layout, model: ModelDims, flags: Flags) -> None:
    tp, name = layout.tp, model.name
    if model.n_head % tp or model.d_model % tp:
        both = [k for k in divisors(math.gcd(model.n_head, model.d_model)) if k <= MAX_DEVICES]
        raise ValueError(
            f"{flags.tp} {tp} does not divide the {name} model's n_head={model.n_head} heads "
            f"and d_model={model.d_model}: use {_either(_near(both, tp))}"
        )
    _check_context(layout, model, flags)
    if layout.sequence_parallel and model.seq_len % tp:
        raise ValueError(
            f"{flags.sequence_parallel} needs the sequence length {model.seq_len} divisible by "
            f"{flags.tp} {tp}: change {flags.seq_len} (e.g. "
            f"{_either(_multiples(tp, model.seq_len))}) or {flags.tp}"
        )
    stages = layout.pp * layout.virtual_stages
    if stages > model.n_layer:
        v = layout.virtual_stages
        chunks = f" x {flags.virtual_stages} {v}" if v > 1 else ""
        raise ValueError(
            f"the {name} model's {model.n_layer} transformer blocks cannot fill {stages} "
            f"pipeline stages ({flags.pp} {layout.pp}{chunks}), each needs a block: use "
            f"{flags.pp} <= {max(1, model.n_layer // v)}"
        )


def _check_context(layout: Layout, model: ModelDims, flags: Flags) -> None:
    """cp splits each sequence into 2 x cp load-balanced chunks (rank r holds chunks r and
    2cp - 1 - r); all_to_all splits each tp rank's heads over cp."""
    cp = layout.cp
    if layout.cp_method not in CP_METHODS:
        raise ValueError(
            f"{flags.cp_method} must be one of {', '.join(CP_METHODS)}, got {layout.cp_method!r}"
        )
    if cp == 1:
        return
    if model.seq_len % (2 * cp):
        raise ValueError(
            f"{flags.cp} {cp} splits each sequence into 2 x cp = {2 * cp} equal chunks: the "
            f"sequence length {model.seq_len} must divide by {2 * cp}: change {flags.seq_len} "
            f"(e.g. {_either(_multiples(2 * cp, model.seq_len))}) or {flags.cp}"
        )
    heads = model.n_head // layout.tp
    if layout.cp_method == "all_to_all" and heads % cp:
        near = _either(_near(divisors(heads), cp))
        raise ValueError(
            f"{flags.cp_method} all_to_all splits the {heads} heads per tp rank of the "
            f"{model.name} model over {flags.cp} {cp}: use {flags.cp} {near} "
            f"or {flags.cp_method} ring"
        )


def _check_micro_batch(layout: Layout, micro_batch: int, flags: Flags) -> None:
    m = layout.pipeline_microbatches
    if layout.pp > 1 and micro_batch % m:
        raise ValueError(
            f"{flags.micro_batch} {micro_batch} does not split into {flags.microbatches} {m} "
            f"equal pipeline micro-batches: use {flags.microbatches} "
            f"{_either(_near(divisors(micro_batch), m))}, or {flags.micro_batch} "
            f"{_either(_multiples(m, micro_batch))}"
        )


def _check_global_batch(layout: Layout, global_batch: int, flags: Flags) -> None:
    dp = layout.dp
    if global_batch % dp:
        per_dp = layout.tp * layout.pp * layout.cp
        worlds = [d * per_dp for d in _near(divisors(global_batch), dp)]
        raise ValueError(
            f"{flags.global_batch} {global_batch} does not split over the {dp} data-parallel "
            f"ranks of {flags.world_is(layout.world_size)}: use {flags.global_batch} "
            f"{_either(_multiples(dp, global_batch))}, or {flags.world_is(_either(worlds))}"
        )

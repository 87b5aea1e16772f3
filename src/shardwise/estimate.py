"""Memory estimates per rank: model states under each ZeRO stage, the peak while the model is
initialized or loaded, and activations of ``GPT``.

The arithmetic is ``shardwise.costmodel.memory`` (model states from the ZeRO stage table, the
init/load peak from them) and
``shardwise.costmodel.activations``; this module names the estimator's entry points and prints
its table.
"""

from __future__ import annotations

from shardwise.bytesize import format_bytes, parse_bytes
from shardwise.costmodel.activations import gpt_saved_activation_bytes
from shardwise.costmodel.memory import (
    InitPeakEstimate,
    StageEstimate,
    check_count,
    gpt_largest_unit_elements,
    init_peak,
    model_states_by_stage,
)
from shardwise.models.gpt import GPTConfig
from shardwise.precision import PRECISIONS
from shardwise.zero.stage import STAGES

__all__ = [
    "PRECISIONS",
    "STAGES",
    "InitPeakEstimate",
    "StageEstimate",
    "estimate_activations",
    "estimate_init_peaks",
    "estimate_model_states",
    "fits",
    "format_bytes",
    "format_estimate_table",
    "format_init_peak_table",
    "parse_bytes",
]


def estimate_model_states(
    num_params: int,
    world_size: int,
    precision: str = "fp32",
    offload: bool = False,
    reduce_dtype: str | None = None,
) -> dict[int, StageEstimate]:
    """Per-rank bytes for params, grads and Adam state at ZeRO stages 0 to 3
    (``shardwise.costmodel.memory.model_states``).

    Args:
        num_params: Ψ, the number of model parameters.
        world_size: N, the number of data-parallel ranks sharding the states.
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` for mixed precision with fp32 master
            weights kept in the optimizer.
        offload: Put the optimizer part (moments and master weights) in host memory.
        reduce_dtype: dtype gradients are reduced in (None: fp32, the engine's default). A
            sharded gradient (stages 2-3) is kept at this dtype, so mixed precision with an fp32
            reduction holds 4 bytes per gradient element there instead of the paper's 2.

    Returns:
        ``{stage: StageEstimate}`` for stages 0, 1, 2, 3. Nothing is communicated.
    """
    check_count("num_params", num_params, 0)
    check_count("world_size", world_size, 1)
    return model_states_by_stage(
        num_params, world_size, precision, offload=offload, reduce_dtype=reduce_dtype
    )


def estimate_activations(
    cfg: GPTConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "fp32",
    checkpointing: bool = False,
) -> int:
    """Bytes of activations ``GPT`` saves for backward on one micro-batch, per rank
    (``shardwise.costmodel.activations.gpt_saved_activation_bytes``).

    Args:
        cfg: Model shape.
        micro_batch: Sequences per forward.
        seq_len: Tokens per sequence (at most ``cfg.seq_len``).
        precision: One of ``PRECISIONS``.
        checkpointing: Whether every block is recomputed in backward.
    """
    return gpt_saved_activation_bytes(cfg, micro_batch, seq_len, precision, checkpointing)


def fits(estimate: StageEstimate, device_memory_bytes: int, activation_bytes: int = 0) -> bool:
    """Whether ``estimate``'s device part plus ``activation_bytes`` fit in the device memory."""
    return estimate.device_bytes + activation_bytes <= device_memory_bytes


def format_estimate_table(
    estimates: dict[int, StageEstimate],
    device_memory_bytes: int | None = None,
    activation_bytes: int = 0,
) -> str:
    """A text table with, per stage, params/grads/optimizer/total bytes per rank.

    ``activation_bytes`` is added to each stage's device total. When ``device_memory_bytes`` is
    given a ``fits`` column says whether the device part fits.
    """
    offload = any(e.offload for e in estimates.values())
    header = ["stage", "params", "grads", "optimizer"]
    if activation_bytes:
        header.append("activations")
    header.append("device/rank")
    if offload:
        header.append("host/rank")
    if device_memory_bytes is not None:
        header.append(f"fits {format_bytes(device_memory_bytes)}")
    rows = [header]
    for stage in sorted(estimates):
        e = estimates[stage]
        row = [str(stage), format_bytes(e.params_bytes), format_bytes(e.grads_bytes)]
        row.append(format_bytes(e.optimizer_bytes) + (" (host)" if e.offload else ""))
        if activation_bytes:
            row.append(format_bytes(activation_bytes))
        row.append(format_bytes(e.device_bytes + activation_bytes))
        if offload:
            row.append(format_bytes(e.host_bytes))
        if device_memory_bytes is not None:
            row.append("yes" if fits(e, device_memory_bytes, activation_bytes) else "no")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def estimate_init_peaks(
    estimates: dict[int, StageEstimate], largest_unit: int, whole_model: int
) -> dict[int, InitPeakEstimate]:
    """Per stage, the most a rank holds while its engine is built and its weights initialized
    or loaded (``shardwise.costmodel.memory.init_peak``): deferred (meta build, unit by unit or
    streamed) and eager (the whole model on every rank first).

    Args:
        estimates: the model states per stage (``estimate_model_states``).
        largest_unit: parameter elements of the largest module (its tp slice), 0 if unknown.
        whole_model: parameter elements of the whole model.
    """
    return {s: init_peak(e, largest_unit, whole_model) for s, e in estimates.items()}


def format_init_peak_table(
    estimates: dict[int, StageEstimate],
    whole_model: int,
    cfg: GPTConfig | None = None,
    tp: int = 1,
) -> str:
    """A headed text table of ``estimate_init_peaks`` by stage, deferred and eager (device
    and host together); the largest module is ``GPT(cfg)``'s at ``tp``, or, without ``cfg``,
    unknown: the deferred figures then say it comes on top."""
    unit = 0 if cfg is None else gpt_largest_unit_elements(cfg, tp)
    peaks = estimate_init_peaks(estimates, unit, whole_model)
    more = "" if cfg is not None else " + largest module"
    rows = [["stage", "deferred init/load", "eager init"]]
    for stage in sorted(peaks):
        p = peaks[stage]
        rows.append(
            [str(stage), format_bytes(p.deferred_bytes) + more, format_bytes(p.eager_bytes)]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    head = "peak per rank while the model is initialized or loaded (device and host)"
    return "\n".join([head, *lines])

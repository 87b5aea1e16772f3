"""Memory estimates per rank: model states under each ZeRO stage, and activations of ``GPT``.

Model states follow the ZeRO paper (Rajbhandari et al., 2020, sec. 3.1 and 5): with Adam(W),
Ψ parameters and N data-parallel ranks, fp32 training holds 4Ψ bytes of params, 4Ψ of grads
and 8Ψ of optimizer state (two moments); mixed precision (bf16/fp16) holds 2Ψ + 2Ψ + 12Ψ
(fp32 master copy plus two moments). Stage 1 shards the optimizer state over N ranks, stage 2
also the grads, stage 3 also the params. A sharded tensor is padded to a multiple of N
elements, so each rank holds ceil(Ψ / N) of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.bytesize import format_bytes, parse_bytes
from shardwise.models.gpt import GPTConfig
from shardwise.precision import PRECISIONS
from shardwise.zero.stage import STAGES, ZeroStage

__all__ = [
    "PRECISIONS",
    "STAGES",
    "StageEstimate",
    "estimate_activations",
    "estimate_model_states",
    "fits",
    "format_bytes",
    "format_estimate_table",
    "parse_bytes",
]


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """Bytes one rank holds for model states under one ZeRO stage."""

    stage: int
    """ZeRO stage, 0 to 3."""
    params_bytes: int
    """Model parameters in the compute dtype."""
    grads_bytes: int
    """Gradients in the compute dtype."""
    optimizer_bytes: int
    """Adam moments, plus the fp32 master weights under mixed precision."""
    offload: bool
    """Whether the optimizer part lives in host memory instead of on the device."""

    @property
    def device_bytes(self) -> int:
        """Bytes on the accelerator."""
        return self.params_bytes + self.grads_bytes + (0 if self.offload else self.optimizer_bytes)

    @property
    def host_bytes(self) -> int:
        """Bytes in host memory (the optimizer part when offloaded)."""
        return self.optimizer_bytes if self.offload else 0

    @property
    def total_bytes(self) -> int:
        """Bytes on device and host together."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose one of {list(PRECISIONS)}")


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: set it to an int >= {minimum}")


def estimate_model_states(
    num_params: int,
    world_size: int,
    precision: str = "fp32",
    offload: bool = False,
    reduce_dtype: str | None = None,
) -> dict[int, StageEstimate]:
    """Per-rank bytes for params, grads and Adam state at ZeRO stages 0 to 3.

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
    _check_int("num_params", num_params, 0)
    _check_int("world_size", world_size, 1)
    _check_precision(precision)
    state_bytes = 4 if precision == "fp32" else 2  # bytes per param and per grad element
    optim_bytes = 8 if precision == "fp32" else 12  # K: two moments (+ fp32 master)
    if reduce_dtype is not None and reduce_dtype not in PRECISIONS:
        allowed = ", ".join(repr(p) for p in PRECISIONS)
        raise ValueError(f"reduce_dtype must be None, {allowed}, got {reduce_dtype!r}")
    shard_grad_bytes = 4 if reduce_dtype in (None, "fp32") else 2
    shard = math.ceil(num_params / world_size)  # elements per rank after padding to N
    estimates = {}
    for stage in STAGES:
        zs = ZeroStage.of(stage)  # what the engine shards at this stage
        estimates[stage] = StageEstimate(
            stage=stage,
            params_bytes=state_bytes * (shard if zs.shard_params else num_params),
            grads_bytes=shard_grad_bytes * shard if zs.shard_grads else state_bytes * num_params,
            optimizer_bytes=optim_bytes * (shard if zs.shard_optimizer else num_params),
            offload=offload,
        )
    return estimates


def _block_bytes(cfg: GPTConfig, tokens: int, micro_batch: int, seq_len: int, act: int) -> int:
    """Bytes one ``Block`` saves for backward."""
    d = cfg.d_model
    # 16 tensors of [tokens, d_model]: block input and ln_attn output, q, k, v, the attention
    # output (out_proj reads a view of it, no copy), the mid-block residual and ln_mlp output,
    # and the 4x MLP hidden before and after GELU.
    stream = 16 * tokens * d * act
    # Each LayerNorm keeps mean and 1/std per token; counted as fp32 (what CUDA keeps).
    norm_stats = 2 * 2 * tokens * 4
    # Flash attention keeps one fp32 logsumexp per head and query.
    logsumexp = micro_batch * cfg.n_head * seq_len * 4
    # Dropout on both residual branches keeps a mask each: one byte per element on CUDA,
    # the activation dtype on CPU; counted at the larger.
    masks = 2 * tokens * d * act if cfg.dropout > 0 else 0
    return stream + norm_stats + logsumexp + masks


def _outside_bytes(cfg: GPTConfig, tokens: int, seq_len: int, act: int) -> int:
    """Bytes saved outside the blocks: embeddings, final norm, head and loss."""
    d = cfg.d_model
    token_ids = tokens * 8 + seq_len * 8  # int64 token and position ids for the embeddings
    emb_mask = tokens * d * act if cfg.dropout > 0 else 0
    final_norm = tokens * d * act + 2 * tokens * 4  # input plus mean and 1/std
    head_input = tokens * d * act  # final norm output, read by the tied head
    # Cross-entropy keeps the log-probabilities and the int64 targets; the logits themselves
    # are not saved (log-softmax's backward needs only its output).
    loss = tokens * cfg.vocab_size * act + tokens * 8
    return token_ids + emb_mask + final_norm + head_input + loss


def estimate_activations(
    cfg: GPTConfig,
    micro_batch: int,
    seq_len: int,
    precision: str = "fp32",
    checkpointing: bool = False,
) -> int:
    """Bytes of activations ``GPT`` saves for backward on one micro-batch, per rank.

    The count follows what ``shardwise.models.gpt`` saves, tensor by tensor, with activations
    in the compute dtype of ``precision`` (the model cast to bf16/fp16 for mixed precision).
    With ``checkpointing`` each block keeps only its input; during backward one block at a time
    is recomputed, so one block's full activations are added on top.

    Args:
        cfg: Model shape.
        micro_batch: Sequences per forward.
        seq_len: Tokens per sequence (at most ``cfg.seq_len``).
        precision: One of ``PRECISIONS``.
        checkpointing: Whether every block is recomputed in backward.
    """
    _check_int("micro_batch", micro_batch, 1)
    _check_int("seq_len", seq_len, 1)
    _check_precision(precision)
    if seq_len > cfg.seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's seq_len={cfg.seq_len}")
    act = 4 if precision == "fp32" else 2
    tokens = micro_batch * seq_len
    block = _block_bytes(cfg, tokens, micro_batch, seq_len, act)
    outside = _outside_bytes(cfg, tokens, seq_len, act)
    if checkpointing:
        block_input = tokens * cfg.d_model * act
        # The recomputed block's own input is one of the kept block inputs: count it once.
        return cfg.n_layer * block_input + (block - block_input) + outside
    return cfg.n_layer * block + outside


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

"""Model-state bytes per rank: parameters, gradients, optimizer states and fp32 masters.

One model for every estimate in shardwise (``shardwise estimate``, the training preflight, the
pipeline table and the cost model's ``predict``). What each ZeRO stage shards comes from
``ZeroStage`` (``shardwise.zero.stage``), the same flags the engine reads.

ZeRO paper (Rajbhandari et al., 2020, sec. 3.1 and 5): with Adam(W), Ψ parameters held by a rank
and N ranks sharding them, fp32 training holds 4Ψ bytes of params, 4Ψ of grads and 8Ψ of
optimizer state (two moments); mixed precision (bf16/fp16) holds 2Ψ + 2Ψ + 12Ψ (fp32 master copy
plus two moments). A sharded tensor is padded to a multiple of N elements, so each rank holds
ceil(Ψ / N) of them. Ψ is what one rank holds before ZeRO: its tensor-parallel slice
(``gpt_params_per_rank``) of its pipeline stage (``gpt_params_per_pp_rank``); N is the group the
states are sharded over: all dp ranks, or under HSDP one shard group (``zero_shard_size``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.models.gpt import GPTConfig
from shardwise.precision import PRECISIONS
from shardwise.zero.stage import STAGES, ZeroStage

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_AND_ADAM_BYTES = 12
"""Per parameter: an fp32 master copy and Adam's two fp32 moments (the master is the weight
itself in fp32)."""
"""Bytes of one parameter, gradient or activation element in each precision."""
FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """Bytes one rank holds for model states under one ZeRO stage."""

    stage: int
    """ZeRO stage, 0 to 3."""
    params_bytes: int
    """Model parameters in the compute dtype."""
    grads_bytes: int
    """Gradients (the full ones in ``grad_dtype``, a shard in the reduce dtype)."""
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


def check_precision(precision: str, name: str = "precision") -> None:
    """``ValueError`` unless ``precision`` is one of ``PRECISIONS``."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown {name} {precision!r}: choose one of {list(PRECISIONS)}")


def check_count(name: str, value: int, minimum: int) -> None:
    """``ValueError`` unless ``value`` is an int (not a bool) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: set it to an int >= {minimum}")


def zero_shard_size(dp: int, dp_replicate: int = 1) -> int:
    """Ranks one ZeRO shard group spans: all ``dp`` ranks, or under HSDP ``dp / dp_replicate``
    (each of the ``dp_replicate`` replicas shards the states over its own ranks)."""
    check_count("dp", dp, 1)
    check_count("dp_replicate", dp_replicate, 1)
    if dp % dp_replicate:
        raise ValueError(f"dp_replicate={dp_replicate} must divide the dp ranks ({dp})")
    return dp // dp_replicate


def model_states(
    num_params: int,
    shard_size: int,
    stage: int,
    precision: str = "fp32",
    *,
    offload: bool = False,
    reduce_dtype: str | None = None,
    grad_dtype: str | None = None,
) -> StageEstimate:
    """Bytes one rank holds for params, grads and Adam(W) state under ZeRO ``stage``.

    Args:
        num_params: Ψ, the parameter elements this rank holds before ZeRO shards them.
        shard_size: N, the ranks sharding the states (``zero_shard_size``).
        stage: ZeRO stage; ``ZeroStage.of(stage)`` says what is sharded.
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` for mixed precision with fp32 master
            weights kept in the optimizer.
        offload: The optimizer part (moments and masters) lives in host memory.
        reduce_dtype: dtype gradients are reduced in (None: fp32, the engine's default). A
            sharded gradient is kept at this dtype.
        grad_dtype: dtype of unsharded gradients (None: the compute dtype, as autograd leaves
            them; ``"fp32"`` for fp32 gradient accumulation).

    Nothing is communicated.
    """
    check_count("num_params", num_params, 0)
    check_count("shard_size", shard_size, 1)
    check_precision(precision)
    for name, dtype in (("reduce_dtype", reduce_dtype), ("grad_dtype", grad_dtype)):
        if dtype is not None and dtype not in PRECISIONS:
            allowed = ", ".join(repr(p) for p in PRECISIONS)
            raise ValueError(f"{name} must be None, {allowed}, got {dtype!r}")
    zs = ZeroStage.of(stage)
    weight = BYTES_PER_ELEMENT[precision]
    # Adam's two fp32 moments, plus the fp32 master copy under mixed precision.
    optimizer = 2 * FP32_BYTES + (0 if precision == "fp32" else FP32_BYTES)
    grad_full = BYTES_PER_ELEMENT[grad_dtype or precision]
    grad_shard = BYTES_PER_ELEMENT[reduce_dtype or "fp32"]
    shard = math.ceil(num_params / shard_size)  # elements per rank after padding to N

    def held(sharded: bool) -> int:
        return shard if sharded else num_params

    return StageEstimate(
        stage=zs.stage,
        params_bytes=weight * held(zs.shard_params),
        grads_bytes=grad_shard * shard if zs.shard_grads else grad_full * num_params,
        optimizer_bytes=optimizer * held(zs.shard_optimizer),
        offload=offload,
    )


def model_states_by_stage(
    num_params: int,
    shard_size: int,
    precision: str = "fp32",
    *,
    offload: bool = False,
    reduce_dtype: str | None = None,
    grad_dtype: str | None = None,
) -> dict[int, StageEstimate]:
    """``{stage: model_states(...)}`` for every ZeRO stage, 0 to 3."""
    return {
        stage: model_states(
            num_params,
            shard_size,
            stage,
            precision,
            offload=offload,
            reduce_dtype=reduce_dtype,
            grad_dtype=grad_dtype,
        )
        for stage in STAGES
    }


def gpt_block_params_per_rank(cfg: GPTConfig, tp: int) -> tuple[int, int]:
    """``(sharded, replicated)`` parameter elements of one ``GPT`` block per tp rank: the
    layers ``tp_plan()`` splits hold 1/tp of their elements; norms and row-parallel biases stay
    whole."""
    if tp < 1 or cfg.n_head % tp or cfg.d_model % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide n_head={cfg.n_head} and d_model")
    d, b = cfg.d_model, int(cfg.bias)
    split_block = 3 * (d * d + b * d) + d * d + (4 * d * d + 4 * b * d) + 4 * d * d
    whole_block = 2 * (d + b * d) + 2 * b * d  # two norms, the row-parallel biases
    return split_block // tp, whole_block


def gpt_params_per_rank(cfg: GPTConfig, tp: int) -> tuple[int, int]:
    """``(sharded, replicated)`` parameter elements one tp rank of ``GPT(cfg)`` holds; the
    vocabulary is padded up to a multiple of tp, the position embedding stays whole."""
    split_block, whole_block = gpt_block_params_per_rank(cfg, tp)
    d, b = cfg.d_model, int(cfg.bias)
    vocab_rows = math.ceil(cfg.vocab_size / tp)  # the tied head shares these rows
    sharded = vocab_rows * d + cfg.n_layer * split_block
    replicated = cfg.seq_len * d + cfg.n_layer * whole_block + (d + b * d)
    return sharded, replicated


def blocks_per_rank(n_layer: int, pp: int) -> list[int]:
    """``n_layer`` blocks over ``pp`` ranks, the first ``n_layer % pp`` ranks one more."""
    if not 1 <= pp <= n_layer:
        raise ValueError(f"pp={pp} must be in 1..n_layer={n_layer}: each stage needs a block")
    return [n_layer // pp + (r < n_layer % pp) for r in range(pp)]


def gpt_params_per_pp_rank(cfg: GPTConfig, pp: int, tp: int = 1) -> list[int]:
    """Parameter elements each pp rank of ``GPT(cfg)`` holds per tp rank: its blocks, the token
    and position embeddings on the first rank, the final norm and (at pp > 1) a copy of the
    tied head on the last. Over all ranks they sum to the model's per tp rank plus that copy."""
    block = sum(gpt_block_params_per_rank(cfg, tp))
    d, b = cfg.d_model, int(cfg.bias)
    vocab = math.ceil(cfg.vocab_size / tp) * d  # the token embedding's rows, tp-split
    out = [n * block for n in blocks_per_rank(cfg.n_layer, pp)]
    out[0] += vocab + cfg.seq_len * d
    out[-1] += d + b * d + (vocab if pp > 1 else 0)
    return out


@dataclass(frozen=True)
class InitPeakEstimate:
    """Bytes one rank holds at most while its engine is built and its weights initialized or
    loaded, on both paths (device and host together, as ``Engine.memory()["init_peak"]``)."""

    deferred_bytes: int
    """Built on the meta device (``shardwise.deferred_init``), initialized unit by unit or
    streamed from a checkpoint: the final model states plus one unit's parameters, the most
    held whole beside them (a module's scratch parameters, or a read of at most a tensor)."""
    eager_bytes: int
    """Built eagerly: the final model states plus the whole model, which every rank holds
    whole at fp32 until the engine has taken its part."""


def init_peak(
    states: StageEstimate, largest_unit_elements: int, whole_model_elements: int
) -> InitPeakEstimate:
    """The init/load peak per rank (``InitPeakEstimate``) of an engine whose final model states
    are ``states`` (``model_states``: the ZeRO table of this rank's tp slice of its pp stage).
    ``largest_unit_elements``: the parameter elements of the largest module held whole while
    initializing (its tp slice); ``whole_model_elements``: what an eager build holds (the
    whole model: every rank builds all of it before it is split). Parameters built on the meta
    device are fp32 and initialized (or read) at fp32, whatever the training precision."""
    check_count("largest_unit_elements", largest_unit_elements, 0)
    check_count("whole_model_elements", whole_model_elements, 0)
    final = states.total_bytes
    return InitPeakEstimate(
        deferred_bytes=final + FP32_BYTES * largest_unit_elements,
        eager_bytes=final + FP32_BYTES * whole_model_elements,
    )


def gpt_largest_unit_elements(cfg: GPTConfig, tp: int = 1) -> int:
    """The parameter elements of ``GPT(cfg)``'s largest module (its own parameters, its tp
    slice): the token embedding (and the head tied to it), the position embedding, or an MLP
    projection."""
    d, b = cfg.d_model, int(cfg.bias)
    gpt_block_params_per_rank(cfg, tp)  # checks tp
    vocab = math.ceil(cfg.vocab_size / tp) * d
    fc_in = (4 * d * d + b * 4 * d) // tp  # column-parallel: weight and bias split
    fc_out = 4 * d * d // tp + b * d  # row-parallel: the bias whole
    return max(vocab, cfg.seq_len * d, fc_in, fc_out)

"""Step time, memory, MFU and scaling of a plan: the cost model.

Per device and step (every term in seconds, ``Prediction.breakdown``):

- compute: FLOPs of forward, backward and recomputation at ``Hardware.flops``, plus
  ``Hardware.micro_batch_overhead_s`` per micro-batch and virtual stage, on the busiest
  pipeline rank (the last holds the output head; ``Plan.stage_layers`` says how the layers are
  split, else evenly);
- tp: tensor-parallel collectives, not overlapped: 2 all-reduces (or all-gather + reduce-scatter
  with sequence parallelism, the same bytes) of b*s*h forward and 2 backward per layer and
  micro-batch, 2 more when full recomputation replays the forward (Narayanan et al. 2021 §3.2);
- bubble: the fill and drain of the schedule on the busiest rank: the other ranks' time per
  micro-batch (compute + tp), over v when interleaved and over 3 for ZB-H1
  (``Plan.bubble_fraction`` of the busy time when the stages are equal);
- p2p: per micro-batch and virtual stage one activation forward and one gradient backward of
  b*s*h/t elements (Megatron's scatter/gather over tp), not overlapped;
- dp: gradient reduction (all-reduce; reduce-scatter + all-gather from ZeRO-2; plus the ZeRO-3
  parameter all-gathers of every micro-batch's forward and backward, frozen weights included;
  gradients and the other gathers are of the trainable parameters only), minus what hides behind
  the backward of the last micro-batch (ZeRO-3: behind all compute) when ``dp_overlap`` and
  the hardware overlaps communication with compute (``Hardware.overlap``);
- cp: context-parallel messages per layer and micro-batch (``costmodel.context``: ring K/V
  blocks or all-to-alls of 1/cp of the activations), not overlapped;
- optimizer: AdamW streaming its states through memory (36 bytes per local trainable
  parameter).

Frozen parameters (``ModelShape.trainable`` < 1, e.g. LoRA's base) hold their weights only,
sharded at ZeRO-3.

Under context parallelism (cp > 1) each rank holds 1/cp of every sequence: compute, tp and p2p
messages and activations are 1/cp of the cp1 plan's, ZeRO shards and gradients reduce over
dp x cp.

Where ranks meet often inside the step (tensor-parallel collectives, pipeline messages), each
meeting costs ``Hardware.sync_loss`` of the compute since the previous one: in all,
``sync_loss`` times the compute, added to tp (to p2p when tp = 1).

Collectives are rings over the slowest link of the group: 2(n-1)(alpha + S/n beta) for an
all-reduce of S bytes, half that for reduce-scatter and all-gather; inside a node a measured
hardware's per-collective fit (``Hardware.collectives``) replaces the link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.comm.allreduce_rounds import LinkCost
from shardwise.costmodel.activations import in_flight_activation_bytes, layer_activation_bytes
from shardwise.costmodel.context import cp_seconds_per_layer
from shardwise.costmodel.hardware import Hardware
from shardwise.costmodel.memory import BYTES_PER_ELEMENT, model_states
from shardwise.costmodel.plan import PRECISIONS, Plan
from shardwise.costmodel.shapes import ModelShape
from shardwise.zero.stage import ZeroStage

GRAD_DTYPE = "fp32"  # gradient accumulation and reduction
GRAD_BYTES = BYTES_PER_ELEMENT[GRAD_DTYPE]
OPTIMIZER_BYTES_TOUCHED = 36  # AdamW: read+write fp32 master, m, v; read grad; write weight


def ring_seconds(link: LinkCost, nbytes: float, n: int, op: str = "all_reduce") -> float:
    """A ring collective of ``nbytes`` (the full tensor) over ``n`` ranks."""
    if n <= 1:
        return 0.0
    rounds = 2 * (n - 1) if op == "all_reduce" else n - 1
    return rounds * (link.alpha_s + nbytes / n * link.beta_s_per_byte)


@dataclass(frozen=True)
class Prediction:
    """One plan's predicted step on one hardware."""

    plan: Plan
    breakdown: dict[str, float]  # seconds: compute, tp, bubble, p2p, dp, cp, optimizer
    memory: dict[str, float]  # bytes per device: states, activations, total
    tokens_per_step: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    peak_flops: float
    memory_capacity: float

    @property
    def step_s(self) -> float:
        return sum(self.breakdown.values())

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_s / self.plan.devices

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / self.step_s / self.plan.devices / self.peak_flops

    @property
    def hardware_flops_per_device(self) -> float:
        """Achieved FLOP/s per device counting recomputation (Megatron's "teraFLOP/s")."""
        return self.hardware_flops_per_step / self.step_s / self.plan.devices

    @property
    def efficiency(self) -> float:
        """Compute over step time: the share of the step doing the model's work."""
        return self.breakdown["compute"] / self.step_s

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory_capacity


def _stage_params(shape: ModelShape, plan: Plan) -> float:
    """Parameters on one device of the heaviest stage (embeddings on the first/last stage)."""
    emb = shape.embedding_params() if plan.pp == 1 else shape.vocab * shape.hidden
    return (shape.layers / plan.pp * shape.layer_params() + emb) / plan.tp


def _trainable_params(shape: ModelShape, plan: Plan) -> float:
    """The trainable part of ``_stage_params`` (spread evenly: LoRA adapts every layer)."""
    return _stage_params(shape, plan) * shape.trainable


def _stage_layers(shape: ModelShape, plan: Plan) -> list[float]:
    """Transformer layers of each pipeline rank (an even split unless the plan says)."""
    if plan.stage_layers is None:
        return [shape.layers / plan.pp] * plan.pp
    if sum(plan.stage_layers) != shape.layers:
        raise ValueError(
            f"Plan.stage_layers {plan.stage_layers} sum to {sum(plan.stage_layers)}, but the "
            f"model has {shape.layers} layers"
        )
    return [float(n) for n in plan.stage_layers]


def _flops_per_micro_batch(
    shape: ModelShape, plan: Plan, layers: float, head: bool
) -> tuple[float, float]:
    """(model, hardware) FLOPs of one micro-batch on a device of a stage with ``layers``
    transformer layers, and the output head when ``head``."""
    tokens = plan.micro_batch * shape.seq_len / plan.cp  # this cp rank's
    layer_fwd = tokens * layers * shape.layer_forward_flops_per_token()
    logits_fwd = tokens * 2 * shape.hidden * shape.vocab if head else 0.0
    model = 3 * (layer_fwd + logits_fwd) / plan.tp
    attention_scores = tokens * layers * 4 * shape.seq_len * shape.hidden  # QK^T and AV
    recomputed = {"none": 0.0, "full": layer_fwd, "selective": attention_scores}[plan.recompute]
    return model, model + recomputed / plan.tp


def _tp_seconds(shape: ModelShape, plan: Plan, hw: Hardware, layers: float) -> float:
    """Tensor-parallel collectives of one micro-batch through ``layers`` layers."""
    if plan.tp == 1:
        return 0.0
    nbytes = plan.micro_batch * shape.seq_len / plan.cp * shape.hidden
    nbytes *= PRECISIONS[plan.precision]
    per_layer = 4 + (2 if plan.recompute == "full" else 0)
    ar = ring_seconds(hw.collective_link("all_reduce", 1, plan.tp), nbytes, plan.tp)
    return layers * per_layer * ar


def _p2p_seconds(shape: ModelShape, plan: Plan, hw: Hardware) -> float:
    if plan.pp == 1:
        return 0.0
    elems = plan.micro_batch * shape.seq_len / plan.cp * shape.hidden / plan.tp
    link = hw.link(plan.dp * plan.cp * plan.tp, 2)
    msgs = 2 * plan.virtual_stages * plan.micro_batches
    return msgs * link.seconds(int(elems * PRECISIONS[plan.precision]))


def _dp_seconds(shape: ModelShape, plan: Plan, hw: Hardware, compute_s: float) -> float:
    n = plan.zero_ranks  # cp ranks reduce their gradients with the dp ranks
    if n == 1:
        return 0.0
    trained = _trainable_params(shape, plan)
    grads = trained * GRAD_BYTES

    def ring(op: str, nbytes: float) -> float:
        return ring_seconds(hw.collective_link(op, plan.tp, n), nbytes, n, op)

    zs = ZeroStage.of(plan.zero_stage)
    if not zs.shard_grads:
        comm = ring("all_reduce", grads)
    elif zs.shard_params:  # every weight, frozen too, gathered for each forward and backward
        weights = _stage_params(shape, plan) * PRECISIONS[plan.precision]
        comm = ring("reduce_scatter", grads) + 2 * plan.micro_batches * ring("all_gather", weights)
    else:  # the updated shards of the trained weights, once
        comm = ring("reduce_scatter", grads)
        comm += ring("all_gather", trained * PRECISIONS[plan.precision])
    if not (plan.dp_overlap and hw.overlap):
        return comm
    window = compute_s if zs.shard_params else compute_s / plan.micro_batches * 2 / 3
    return max(0.0, comm - window)


def _pipeline(
    shape: ModelShape, plan: Plan, hw: Hardware
) -> tuple[float, float, float, float, float]:
    """(compute, tp, bubble, model FLOPs, hardware FLOPs) of one step on the busiest pipeline
    rank; FLOPs per micro-batch summed over the ranks of one pipeline.

    A micro-batch keeps rank i busy b_i (compute + tp); the step takes m * max(b) on the busiest
    rank plus the others' share of the fill and drain, sum(b) - max(b), divided by v
    (interleaved) or 3 (ZB-H1: the weight gradients fill the drain): with equal stages this is
    ``Plan.bubble_fraction`` of the busy time.
    """
    m, layers = plan.micro_batches, _stage_layers(shape, plan)
    busy, comp, tps = [], [], []
    model_flops = hw_flops = 0.0
    for rank, n in enumerate(layers):
        model_mb, hw_mb = _flops_per_micro_batch(shape, plan, n, rank == plan.pp - 1)
        model_flops, hw_flops = model_flops + model_mb, hw_flops + hw_mb
        comp.append(hw_mb / hw.flops + hw.micro_batch_overhead_s * plan.virtual_stages)
        tps.append(_tp_seconds(shape, plan, hw, n))
        busy.append(comp[-1] + tps[-1])
    top = max(range(plan.pp), key=lambda i: busy[i])
    spread = {"interleaved": plan.virtual_stages, "zb-h1": 3}.get(plan.schedule, 1)
    bubble = (sum(busy) - busy[top]) / spread
    return m * comp[top], m * tps[top], bubble, model_flops, hw_flops


def _memory(shape: ModelShape, plan: Plan) -> dict[str, float]:
    """Bytes per device: model states by ZeRO stage (``memory.model_states``, fp32 gradients)
    of the trainable parameters and the frozen ones' weights, activations of the busiest rank
    (Korthikanti et al. 2022) plus the fp32 logits."""
    params, trained = _stage_params(shape, plan), _trainable_params(shape, plan)
    states = model_states(
        math.ceil(trained),
        plan.zero_ranks,
        plan.zero_stage,
        plan.precision,
        grad_dtype=GRAD_DTYPE,
    ).total_bytes
    frozen = math.ceil(params - trained)
    if frozen:
        shards = plan.zero_ranks if ZeroStage.of(plan.zero_stage).shard_params else 1
        states += math.ceil(frozen / shards) * PRECISIONS[plan.precision]
    per_layer = layer_activation_bytes(
        shape.seq_len,
        plan.micro_batch,
        shape.hidden,
        shape.heads,
        plan.tp,
        plan.sequence_parallel,
        plan.recompute,
        element_bytes=PRECISIONS[plan.precision],
    )
    layers = shape.layers / plan.pp
    in_flight = plan.in_flight_micro_batches()
    acts = in_flight_activation_bytes(per_layer, layers, in_flight) / plan.cp  # 1/cp of tokens
    logits = shape.seq_len / plan.cp * plan.micro_batch * shape.vocab * 4 / plan.tp  # fp32
    return {"states": states, "activations": acts + logits, "total": states + acts + logits}


def predict(shape: ModelShape, plan: Plan, hw: Hardware) -> Prediction:
    """The predicted step of ``plan`` for ``shape`` on ``hw`` (see the module docstring)."""
    compute, tp, bubble, model_mb, hw_mb = _pipeline(shape, plan, hw)
    p2p = _p2p_seconds(shape, plan, hw)
    sync = compute * hw.sync_loss  # ranks meeting through the step: each meeting waits
    if plan.tp > 1:
        tp += sync
    elif plan.pp > 1:
        p2p += sync
    sharded = ZeroStage.of(plan.zero_stage).shard_optimizer
    opt_params = _trainable_params(shape, plan) / (plan.zero_ranks if sharded else 1)
    cp = (
        plan.micro_batches * max(_stage_layers(shape, plan)) * cp_seconds_per_layer(shape, plan, hw)
    )
    breakdown = {
        "compute": compute,
        "tp": tp,
        "bubble": bubble,
        "p2p": p2p,
        "dp": _dp_seconds(shape, plan, hw, compute),
        "cp": cp,
        "optimizer": opt_params * OPTIMIZER_BYTES_TOUCHED / hw.memory_bw_bytes_per_s,
    }
    # model_mb, hw_mb: one micro-batch through one pipeline, on one of its cp x tp ranks
    replicas = plan.dp * plan.cp * plan.tp
    return Prediction(
        plan=plan,
        breakdown=breakdown,
        memory=_memory(shape, plan),
        tokens_per_step=plan.global_batch * shape.seq_len,
        model_flops_per_step=plan.micro_batches * model_mb * replicas,
        hardware_flops_per_step=plan.micro_batches * hw_mb * replicas,
        peak_flops=hw.peak_flops,
        memory_capacity=hw.memory_bytes,
    )

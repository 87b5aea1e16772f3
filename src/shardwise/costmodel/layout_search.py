"""Every layout of a training step over N devices that fits in memory, ranked by predicted step
time: the mesh (dp_replicate x dp_shard x cp x tp x pp, with cp's method), ZeRO stage,
recomputation, micro-batch and accumulation, pipeline schedule and virtual stages, all-reduce
algorithm and optimizer offload.

``Plan`` prices dp x tp x pp; a ``Layout`` adds what the plan does not price (HSDP replicas, the
all-reduce algorithm, offload) and ``predict_layout`` prices them on top of ``predict``:

- HSDP (``dp_replicate`` r > 1): model states shard over the r-th part of dp (``dp_shard``),
  which reduces as a plan of that dp would; the replicas then all-reduce the shard (1/dp_shard
  of the gradients) over r ranks;
- an all-reduce algorithm other than the backend's (ZeRO-0): the gradient all-reduce is priced
  by ``comm.allreduce_rounds.predict_seconds`` over the point-to-point links instead of the fitted
  ring step;
- optimizer offload: the fp32 master weights and moments leave the device (memory), the
  optimizer streams them through host memory and the gradients and weights cross the host link.

Mesh axes are named in ``AXES`` in the mesh's order; a new axis is one more name there, a
degree in ``Layout.degrees`` and its rule in ``_axis_allowed`` (cp: the sequence splits into
2 x cp chunks; all_to_all also splits each tp rank's heads over cp).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardwise.comm.allreduce_rounds import GroupLinks, predict_seconds
from shardwise.costmodel.hardware import Hardware
from shardwise.costmodel.memory import MASTER_AND_ADAM_BYTES
from shardwise.costmodel.plan import CP_METHODS, PRECISIONS, SCHEDULES, Plan
from shardwise.costmodel.predict import (
    GRAD_BYTES,
    OPTIMIZER_BYTES_TOUCHED,
    Prediction,
    predict,
    ring_seconds,
)
from shardwise.costmodel.search import MICRO_BATCHES
from shardwise.costmodel.shapes import ModelShape

AXES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
"""Mesh axes the search factors the devices into, outermost first."""

StageLayers = Callable[[int, int], "tuple[int, ...] | None"]
"""(pp, virtual stages) -> transformer layers per pp rank; ``ValueError`` if it cannot split."""


@dataclass(frozen=True)
class Layout:
    """One way to run a step: ``plan`` (its ``dp`` is dp_replicate x dp_shard) plus what the
    plan does not price (see the module docstring)."""

    plan: Plan
    dp_replicate: int = 1
    allreduce_algorithm: str = "native"
    offload_optimizer: bool = False

    @property
    def dp_shard(self) -> int:
        return self.plan.dp // self.dp_replicate

    @property
    def zero_shard(self) -> int:
        """Ranks one ZeRO shard group spans: dp_shard x cp."""
        return self.dp_shard * self.plan.cp

    @property
    def degrees(self) -> dict[str, int]:
        """Size of each mesh axis in ``AXES``."""
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.plan.cp,
            "tp": self.plan.tp,
            "pp": self.plan.pp,
        }

    def describe(self) -> str:
        text = self.plan.describe()
        if self.dp_replicate > 1:
            text = text.replace(f"dp{self.plan.dp} ", f"dp{self.dp_replicate}x{self.dp_shard} ")
        if self.allreduce_algorithm != "native":
            text += f" ar={self.allreduce_algorithm}"
        return text + (" offload" if self.offload_optimizer else "")


@dataclass(frozen=True)
class SearchSpace:
    """The choices searched per dimension (the mesh degrees: every factorization allowed)."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = SCHEDULES
    virtual_stages: int = 2
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    sequence_parallel: tuple[bool, ...] = (False, True)
    cp_methods: tuple[str, ...] = CP_METHODS
    allreduce_algorithms: tuple[str, ...] = ("native",)
    offload: tuple[bool, ...] = (False,)
    hsdp: bool = True
    fixed_axes: tuple[str, ...] = ()
    """Mesh axes (``AXES``) held at one: a parallelism the command that runs it lacks."""
    precision: str = "bf16"
    host_bw_bytes_per_s: float = 0.0  # the device-host link, for offload (0: not offloading)
    keep: Callable[[Layout], bool] | None = field(default=None, compare=False)
    """A caller's last word (e.g. the pins and checks of the command that will run it)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fixed_axes) - set(AXES))
        if unknown:
            raise ValueError(f"fixed_axes {unknown} are not mesh axes; axes: {', '.join(AXES)}")


def _factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive ints whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for k in (d for d in range(1, n + 1) if n % d == 0):
        for rest in _factorizations(n // k, parts - 1):
            yield (k, *rest)


def _axis_allowed(axis: str, size: int, shape: ModelShape, hw: Hardware, zero: int) -> bool:
    if axis == "tp":
        kv = shape.kv_heads or shape.heads
        return size <= hw.devices_per_node and shape.heads % size == 0 and kv % size == 0
    if axis == "cp":
        return shape.seq_len % (2 * size) == 0
    if axis == "dp_replicate":  # HSDP replicates ZeRO shards; without sharding it is plain dp
        return size == 1 or zero > 0
    return True


def even_stage_layers(shape: ModelShape) -> StageLayers:
    """Stage layers of a shape split evenly (``ValueError`` unless pp x v divides the layers)."""

    def split(pp: int, v: int) -> tuple[int, ...] | None:
        if shape.layers % (pp * v):
            raise ValueError(f"{shape.layers} layers do not split into {pp * v} stages")
        return None

    return split


def _pipeline_choices(
    space: SearchSpace, pp: int, stages: StageLayers
) -> list[tuple[str, int, tuple[int, ...] | None]]:
    if pp == 1:
        return [("1f1b", 1, None)]
    out = []
    for sched in space.schedules:
        v = space.virtual_stages if sched == "interleaved" else 1
        try:
            out.append((sched, v, stages(pp, v)))
        except ValueError:
            continue
    return out


def candidates(
    shape: ModelShape,
    devices: int,
    hw: Hardware,
    global_batch: int,
    space: SearchSpace,
    stages: StageLayers | None = None,
) -> Iterator[Layout]:
    """Every layout of ``space`` for ``global_batch`` sequences on ``devices``, fitting or not."""
    stages = stages or even_stage_layers(shape)
    for degrees in _factorizations(devices, len(AXES)):
        size = dict(zip(AXES, degrees, strict=True))
        r, s, cp, tp, pp = (size[a] for a in AXES)
        dp = r * s
        if global_batch % dp or not all(
            _axis_allowed(a, size[a], shape, hw, 0) for a in ("tp", "cp")
        ):
            continue
        if any(size[a] > 1 for a in space.fixed_axes):
            continue
        per_rank = global_batch // dp
        for (sched, v, layers), method, zero, rec, b, sp, alg, off in itertools.product(
            _pipeline_choices(space, pp, stages),
            _cp_methods(space, shape, cp, tp),
            space.zero_stages,
            space.recompute,
            space.micro_batches,
            space.sequence_parallel,
            space.allreduce_algorithms,
            space.offload,
        ):
            if (
                per_rank % b
                or (sp and tp == 1)
                or not _axis_allowed("dp_replicate", r, shape, hw, zero)
            ):
                continue
            if (r > 1 and not space.hsdp) or (alg != "native" and (zero > 0 or dp == 1 or r > 1)):
                continue
            plan = Plan(dp=dp, tp=tp, pp=pp, schedule=sched, virtual_stages=v,
                        micro_batches=per_rank // b, micro_batch=b, zero_stage=zero,
                        sequence_parallel=sp, recompute=rec, precision=space.precision,
                        stage_layers=layers, cp=cp, cp_method=method)  # fmt: skip
            yield Layout(plan, r, alg, off)


def _cp_methods(space: SearchSpace, shape: ModelShape, cp: int, tp: int) -> list[str]:
    """The cp methods a cp x tp mesh can run: one (ring) without cp; all_to_all when cp
    divides the heads and key/value heads per tp rank."""
    if cp == 1:
        return ["ring"]
    heads = (shape.heads // tp, (shape.kv_heads or shape.heads) // tp)
    return [m for m in space.cp_methods if m == "ring" or all(h % cp == 0 for h in heads)]


def _group_links(hw: Hardware, spacing: int, n: int) -> GroupLinks:
    nodes = tuple(i * spacing // hw.devices_per_node for i in range(n))
    return GroupLinks(nodes, hw.intra, hw.inter)


def _dp_comm(shape: ModelShape, layout: Layout, hw: Hardware, base: Prediction) -> float:
    """The dp term of a layout whose plan alone does not price it (HSDP, an algorithm)."""
    plan = layout.plan
    if layout.dp_replicate > 1:
        inner = predict(shape, dataclasses.replace(plan, dp=layout.dp_shard), hw)
        grads = _local_params(shape, plan) * shape.trainable * GRAD_BYTES / layout.zero_shard
        link = hw.collective_link("all_reduce", plan.tp * layout.zero_shard, layout.dp_replicate)
        return inner.breakdown["dp"] + ring_seconds(link, grads, layout.dp_replicate)
    nbytes = int(_local_params(shape, plan) * shape.trainable) * GRAD_BYTES
    links = _group_links(hw, plan.tp, plan.zero_ranks)
    comm = predict_seconds(layout.allreduce_algorithm, nbytes, GRAD_BYTES, links)
    if not (plan.dp_overlap and hw.overlap):
        return comm
    return max(0.0, comm - base.breakdown["compute"] / plan.micro_batches * 2 / 3)


def _local_params(shape: ModelShape, plan: Plan) -> float:
    """Parameters of one device of the heaviest stage (as the cost model counts them), frozen
    ones included."""
    emb = shape.embedding_params() if plan.pp == 1 else shape.vocab * shape.hidden
    return (shape.layers / plan.pp * shape.layer_params() + emb) / plan.tp


def predict_layout(
    shape: ModelShape, layout: Layout, hw: Hardware, host_bw_bytes_per_s: float = 0.0
) -> Prediction:
    """The predicted step of ``layout`` (``predict`` of its plan, then the module docstring's
    terms). ``host_bw_bytes_per_s``: the device-host link, needed for offload."""
    plan = layout.plan
    base = predict(shape, plan, hw)
    breakdown, memory = dict(base.breakdown), dict(base.memory)
    if layout.dp_replicate > 1 or layout.allreduce_algorithm != "native":
        breakdown["dp"] = _dp_comm(shape, layout, hw, base)
    if layout.dp_replicate > 1:
        memory = predict(shape, dataclasses.replace(plan, dp=layout.dp_shard), hw).memory
    if layout.offload_optimizer:
        if host_bw_bytes_per_s <= 0:
            raise ValueError("offload needs the device-host bandwidth (host_bw_bytes_per_s > 0)")
        shard = layout.zero_shard if plan.zero_stage >= 1 else 1
        owned = _local_params(shape, plan) * shape.trainable / shard
        w = PRECISIONS[plan.precision]
        memory["states"] -= owned * (MASTER_AND_ADAM_BYTES - (4 if w == 4 else 0))
        memory["total"] = memory["states"] + memory["activations"]
        crossing = owned * (GRAD_BYTES + w) / host_bw_bytes_per_s  # grads down, weights up
        breakdown["optimizer"] = owned * OPTIMIZER_BYTES_TOUCHED / hw.memory_bw_bytes_per_s
        breakdown["optimizer"] += crossing
    return dataclasses.replace(base, breakdown=breakdown, memory=memory)


@dataclass(frozen=True)
class Ranked:
    """A layout with its prediction."""

    layout: Layout
    prediction: Prediction


@dataclass(frozen=True)
class SearchResult:
    """The fitting layouts, fastest first; how many were priced; the smallest memory need."""

    ranked: list[Ranked]
    searched: int
    smallest: Ranked | None  # the layout needing least memory per device, fitting or not


def search(
    shape: ModelShape,
    devices: int,
    hw: Hardware,
    global_batch: int,
    space: SearchSpace | None = None,
    stages: StageLayers | None = None,
) -> SearchResult:
    """Price every layout of ``space`` (default: all) and rank those that fit and that
    ``space.keep`` keeps by predicted step time (ties: less memory)."""
    if devices < 1 or global_batch < 1:
        raise ValueError(f"devices and global_batch must be >= 1, got {devices}, {global_batch}")
    space = space or SearchSpace()
    ranked, smallest, searched = [], None, 0
    for layout in candidates(shape, devices, hw, global_batch, space, stages):
        if space.keep is not None and not space.keep(layout):
            continue
        pred = predict_layout(shape, layout, hw, space.host_bw_bytes_per_s)
        searched += 1
        if smallest is None or pred.memory["total"] < smallest.prediction.memory["total"]:
            smallest = Ranked(layout, pred)
        if pred.fits:
            ranked.append(Ranked(layout, pred))
    ranked.sort(key=lambda r: (r.prediction.step_s, r.prediction.memory["total"]))
    return SearchResult(ranked, searched, smallest)


def ranks_to_fit(
    shape: ModelShape,
    hw: Hardware,
    space: SearchSpace,
    start: int,
    stages: StageLayers | None = None,
    limit: int = 1 << 12,
) -> int | None:
    """The smallest power-of-two device count from ``start`` at which some layout of ``space``
    fits, or None up to ``limit``: the least memory a count allows, so its meshes with one
    sequence per dp rank and ``space``'s most frugal choices (ZeRO-3 if searched, the most
    recomputation, one sequence per micro-batch), the devices all in one node."""
    n = 1
    while n < start:
        n *= 2
    frugal = {"none": 0, "selective": 1, "full": 2}
    unpinned = dataclasses.replace(
        space,
        keep=None,
        zero_stages=(max(space.zero_stages),),
        recompute=(max(space.recompute, key=frugal.__getitem__),),
        micro_batches=(1,),
        allreduce_algorithms=("native",),
        schedules=("1f1b",),
    )
    while n <= limit:
        wide = dataclasses.replace(hw, devices_per_node=max(hw.devices_per_node, n))
        if search(shape, n, wide, n, unpinned, stages).ranked:
            return n
        n *= 2
    return None


def prediction_record(pred: Prediction) -> dict[str, Any]:
    """A prediction as JSON: step seconds, its breakdown, memory bytes per device, and the
    communication seconds per step (tp + p2p + dp + cp, exposed)."""
    b = pred.breakdown
    return {
        "step_time_s": pred.step_s,
        "breakdown_s": dict(b),
        "memory_bytes_per_rank": dict(pred.memory),
        "comm_s_per_step": b["tp"] + b["p2p"] + b["dp"] + b.get("cp", 0.0),
        "tokens_per_s": pred.tokens_per_step / pred.step_s,
    }


def layout_record(layout: Layout) -> dict[str, Any]:
    """A layout as JSON (``layout_from_record`` reads it back)."""
    return {
        "plan": dataclasses.asdict(layout.plan),
        "dp_replicate": layout.dp_replicate,
        "allreduce_algorithm": layout.allreduce_algorithm,
        "offload_optimizer": layout.offload_optimizer,
        "describe": layout.describe(),
    }


def layout_from_record(data: Mapping[str, Any]) -> Layout:
    plan = dict(data["plan"])
    if plan.get("stage_layers") is not None:
        plan["stage_layers"] = tuple(plan["stage_layers"])
    return Layout(
        Plan(**plan),
        int(data["dp_replicate"]),
        str(data["allreduce_algorithm"]),
        bool(data["offload_optimizer"]),
    )

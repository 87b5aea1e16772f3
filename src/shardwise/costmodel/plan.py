"""A parallel plan: how a model's training step is split over devices."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
CP_METHODS = ("ring", "all_to_all")
PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes of a weight / activation element


@dataclass(frozen=True)
class Plan:
    """dp x cp x tp x pp devices; ``micro_batches`` of ``micro_batch`` sequences per dp rank.

    ``cp`` ranks split each sequence (context parallelism, ``cp_method`` ``ring`` or
    ``all_to_all``; see ``costmodel.context``): they read the same sequences, and ZeRO shards
    over dp x cp.

    ``virtual_stages`` is the interleaving degree v (interleaved only); ``sequence_parallel``
    splits the activations outside the tensor-parallel regions over tp (Korthikanti et al.
    2022); ``zero_stage`` shards over dp (1: optimizer states, 2: + gradients, 3: + params);
    ``dp_overlap`` hides data-parallel communication behind the backward pass where it can.
    ``stage_layers``: the transformer layers of each pipeline rank, first to last (``None``:
    an even split); the first rank also holds the embedding, the last the output head.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    micro_batch: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "bf16"
    dp_overlap: bool = True
    stage_layers: tuple[int, ...] | None = None
    cp: int = 1
    cp_method: str = "ring"

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp", "cp", "virtual_stages", "micro_batches", "micro_batch"):
            if getattr(self, f) < 1:
                raise ValueError(f"Plan.{f} must be >= 1, got {getattr(self, f)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan.schedule {self.schedule!r}; allowed: {SCHEDULES}")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"Plan.cp_method {self.cp_method!r}; allowed: {CP_METHODS}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Plan.recompute {self.recompute!r}; allowed: {RECOMPUTE}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Plan.precision {self.precision!r}; allowed: {list(PRECISIONS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Plan.zero_stage must be 0-3, got {self.zero_stage}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError("virtual_stages > 1 needs schedule='interleaved'")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.stage_layers is not None and (
            len(self.stage_layers) != self.pp or min(self.stage_layers) < 0
        ):
            raise ValueError(
                f"Plan.stage_layers needs one layer count >= 0 per pipeline rank ({self.pp}), "
                f"got {self.stage_layers}"
            )

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def zero_ranks(self) -> int:
        """Ranks ZeRO shards over and gradients reduce over: dp x cp (cp ranks hold the same
        parameters)."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per step."""
        return self.dp * self.micro_batches * self.micro_batch

    def bubble_fraction(self) -> float:
        """Idle time of a pipeline stage over its busy time (Narayanan et al. 2021 §2.2;
        ZB-H1: Qi et al. 2023 with equal F, B, W times)."""
        p, m, v = self.pp, self.micro_batches, self.virtual_stages
        if p == 1:
            return 0.0
        if self.schedule == "interleaved":
            return (p - 1) / (v * m)
        if self.schedule == "zb-h1":
            return (p - 1) / (3 * m)
        return (p - 1) / m

    def in_flight_micro_batches(self) -> float:
        """Micro-batches whose activations stage 0 holds at its peak, in units of its layers'
        activations for one micro-batch."""
        p, m, v = self.pp, self.micro_batches, self.virtual_stages
        if self.schedule == "gpipe":
            return float(m)
        if self.schedule == "interleaved" and v > 1:
            return min(p, m) * (1 + (p - 1) / (p * v))
        return float(min(p, m))

    def describe(self) -> str:
        sched = self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        extras = [f"zero{self.zero_stage}", f"recompute={self.recompute}", self.precision]
        if self.sequence_parallel:
            extras.append("sp")
        cp = f"cp{self.cp}{'' if self.cp_method == 'ring' else '(a2a)'} " if self.cp > 1 else ""
        return (
            f"dp{self.dp} {cp}tp{self.tp} pp{self.pp} {sched} m={self.micro_batches} "
            f"b={self.micro_batch} " + " ".join(extras)
        )

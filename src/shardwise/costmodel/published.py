"""Published training throughputs the cost model is checked against, with their sources.

Each figure is reproduced from the run's stated hardware and plan. ``calibration`` marks the
figure a hardware preset's ``matmul_efficiency`` was fitted on; the others are predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.costmodel.hardware import hardware
from shardwise.costmodel.plan import Plan
from shardwise.costmodel.predict import predict
from shardwise.costmodel.shapes import shape

MEGATRON = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM (arXiv 2104.04473), Table 1: A100 80GB (Selene), seq 2048, vocab 51200, "
    "micro-batch 1, activation recomputation; metric: achieved teraFLOP/s per GPU"
)
TORCHTITAN = (
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP, local batch 2, "
    "seq 8192, selective activation checkpointing, bf16 eager; Table 1 (8 GPUs) and Table 3 "
    "(128 GPUs); metric: tokens/s per GPU"
)


@dataclass(frozen=True)
class Figure:
    label: str
    model: str
    hardware: str
    plan: Plan
    metric: str  # "tflops_per_device" | "tokens_per_s_per_device"
    published: float
    source: str
    calibration: bool = False

    def predicted(self) -> float:
        pred = predict(shape(self.model), self.plan, hardware(self.hardware))
        if self.metric == "tflops_per_device":
            return pred.hardware_flops_per_device / 1e12
        return pred.tokens_per_s_per_device

    def error(self) -> float:
        return self.predicted() / self.published - 1


def _megatron(label: str, model: str, t: int, p: int, gpus: int, batch: int, tf: float) -> Figure:
    d = gpus // (t * p)
    plan = Plan(dp=d, tp=t, pp=p, micro_batches=batch // d, recompute="full")
    return Figure(label, model, "a100x8-ib", plan, "tflops_per_device", tf, MEGATRON,
                  calibration=model == "gpt-1t")  # fmt: skip


def _titan(gpus: int, tps: float) -> Figure:
    plan = Plan(dp=gpus, micro_batch=2, zero_stage=3, recompute="selective")
    return Figure(f"Llama 3.1 8B FSDP, {gpus} H100", "llama3-8b", "h100x8-ib", plan,
                  "tokens_per_s_per_device", tps, TORCHTITAN, calibration=gpus == 8)  # fmt: skip


FIGURES: tuple[Figure, ...] = (
    _megatron("GPT 18B, 256 A100 (t8 p1)", "gpt-18b", 8, 1, 256, 1024, 135),
    _megatron("GPT 145B, 1536 A100 (t8 p8)", "gpt-145b", 8, 8, 1536, 2304, 148),
    _megatron("GPT 310B, 1920 A100 (t8 p16)", "gpt-310b", 8, 16, 1920, 2160, 155),
    _megatron("GPT 530B, 2520 A100 (t8 p35)", "gpt-530b", 8, 35, 2520, 2520, 163),
    _megatron("GPT 1T, 3072 A100 (t8 p64)", "gpt-1t", 8, 64, 3072, 3072, 163),
    _titan(8, 5762),
    _titan(128, 5605),
)


def comparison_table() -> str:
    """The figures as a Markdown table: published, predicted, error."""
    lines = [
        "| run | metric | published | predicted | error | role |",
        "|---|---|---:|---:|---:|---|",
    ]
    for f in FIGURES:
        unit = "TFLOP/s/GPU" if f.metric == "tflops_per_device" else "tokens/s/GPU"
        role = "calibration" if f.calibration else "prediction"
        lines.append(
            f"| {f.label} | {unit} | {f.published:,.0f} | {f.predicted():,.0f} | "
            f"{f.error():+.1%} | {role} |"
        )
    return "\n".join(lines)

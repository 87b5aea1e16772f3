"""Hardware the cost model runs on: per-device FLOP/s and memory, and the alpha-beta of the
links inside a node and across nodes (named presets with their sources, or measured here)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from shardwise.comm.allreduce_rounds import LinkCost


@dataclass(frozen=True)
class Hardware:
    """One kind of device, ``devices_per_node`` to a node.

    ``matmul_efficiency`` is the share of ``peak_flops`` a training step's kernels reach on
    this hardware and software: a calibration, named in ``sources`` with the run it came from.
    Links are per device and direction; a collective's ring runs at the slowest link it uses.

    ``collectives`` (measured hardware): per collective ("all_reduce", "all_gather",
    "reduce_scatter"), the alpha-beta of one ring step inside a node fitted to timed collectives
    (``costmodel.calibrate``), used instead of ``intra`` for them: a backend's collectives copy
    and reduce, and reach less than a point-to-point message's bandwidth. ``overlap`` says
    whether communication runs beside compute (GPUs: copy engines and NCCL's own SMs) or on the
    cores the compute needs (a CPU backend: gloo reduces on them), in which case no
    communication hides.

    ``sync_loss`` (measured hardware): the share of the compute between two blocking
    collectives (or messages) that the ranks lose meeting at them: each segment ends when the
    slowest rank's does (skew from noise on shared cores), and the transfer leaves the caches
    cold. It applies where a step meets often (tensor parallel, pipeline); the once-per-step
    meeting of data parallelism is already in a step-time calibration. Measured by
    ``calibrate.measure_sync_loss``; 0 in the presets (their calibrations come from whole runs).

    ``micro_batch_overhead_s`` (measured hardware): the fixed seconds of one micro-batch's
    forward and backward besides its FLOPs (launches, the framework's own work), which make
    many small micro-batches slower than few large ones; 0 in the presets.
    """

    name: str
    peak_flops: float  # dense, in the training precision
    memory_bytes: int
    memory_bw_bytes_per_s: float
    devices_per_node: int
    intra: LinkCost
    inter: LinkCost
    matmul_efficiency: float
    sources: str
    collectives: Mapping[str, LinkCost] = field(default_factory=dict)
    overlap: bool = True
    sync_loss: float = 0.0
    micro_batch_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.sync_loss < 1:
            raise ValueError(f"sync_loss must be in [0, 1), got {self.sync_loss}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")
        if self.peak_flops <= 0 or self.memory_bytes <= 0 or self.devices_per_node < 1:
            raise ValueError("peak_flops, memory_bytes and devices_per_node must be positive")

    @property
    def flops(self) -> float:
        """Achieved FLOP/s of the training kernels."""
        return self.peak_flops * self.matmul_efficiency

    def link(self, ranks_apart: int, group_size: int) -> LinkCost:
        """The link a group uses whose members are ``ranks_apart`` apart in rank order: inside
        a node when the whole group fits in one."""
        span = ranks_apart * (group_size - 1) + 1
        return self.intra if span <= self.devices_per_node else self.inter

    def collective_link(self, op: str, ranks_apart: int, group_size: int) -> LinkCost:
        """The per-ring-step link of collective ``op`` over such a group: the fitted one inside a
        node when ``collectives`` has it, else ``link``."""
        link = self.link(ranks_apart, group_size)
        if link is self.intra and op in self.collectives:
            return self.collectives[op]
        return link


def _bw(gbytes_per_s: float) -> float:
    return 1.0 / (gbytes_per_s * 1e9)


GiB = 1 << 30

PRESETS: dict[str, Hardware] = {
    "a100x8-ib": Hardware(
        "a100x8-ib",
        peak_flops=312e12,
        memory_bytes=80 * GiB,
        memory_bw_bytes_per_s=2.039e12,
        devices_per_node=8,
        intra=LinkCost(5e-6, _bw(300 * 0.8)),
        inter=LinkCost(10e-6, _bw(25 * 0.8)),
        matmul_efficiency=0.66,
        sources=(
            "A100 SXM4 80GB datasheet: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, NVLink3 600 GB/s "
            "(300 GB/s per direction); DGX A100 (Selene): 8 HDR 200 Gb/s HCAs per node (25 GB/s "
            "per GPU); links at 80% of line rate (nccl-tests busbw on DGX A100 ~230 GB/s); "
            "matmul_efficiency calibrated on Narayanan et al. 2021 Table 1, 1T row (163 TFLOP/s "
            "per GPU on 3072 A100)"
        ),
    ),
    "h100x8-ib": Hardware(
        "h100x8-ib",
        peak_flops=989e12,
        memory_bytes=80 * GiB,
        memory_bw_bytes_per_s=3.35e12,
        devices_per_node=8,
        intra=LinkCost(5e-6, _bw(450 * 0.8)),
        inter=LinkCost(10e-6, _bw(50 * 0.8)),
        matmul_efficiency=0.37,
        sources=(
            "H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink4 900 "
            "GB/s (450 per direction); 400 Gb/s InfiniBand NDR per GPU (50 GB/s); links at 80% "
            "of line rate; matmul_efficiency calibrated on torchtitan's Llama 3.1 8B FSDP run "
            "on 8 H100 (benchmarks/llama3_h100_202412_torchtitan.md, Table 1: 5,762 tokens/s "
            "per GPU, eager bf16)"
        ),
    ),
}
PRESETS["h200x8-ib"] = replace(
    PRESETS["h100x8-ib"],
    name="h200x8-ib",
    memory_bytes=141 * 10**9,
    memory_bw_bytes_per_s=4.8e12,
    sources="H200 SXM datasheet: as H100 SXM with 141 GB HBM3e at 4.8 TB/s; links and "
    "efficiency as h100x8-ib",
)


def hardware(name: str) -> Hardware:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def measure_matmul_flops(
    device: torch.device | str = "cpu", n: int = 1024, dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of an n x n matmul on ``device`` (best of 5 after a warm-up)."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    for i in range(6):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure_memory_bandwidth(device: torch.device | str = "cpu", nbytes: int = 64 << 20) -> float:
    """Bytes/s of a device-to-device copy (read + write; best of 5 after a warm-up)."""
    dev = torch.device(device)
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(6):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def measured(
    links: tuple[LinkCost, LinkCost],
    devices_per_node: int,
    flops: float,
    memory_bytes: int,
    memory_bw_bytes_per_s: float,
    collectives: Mapping[str, LinkCost] | None = None,
    overlap: bool = True,
    sync_loss: float = 0.0,
    micro_batch_overhead_s: float = 0.0,
) -> Hardware:
    """Hardware from what was measured here: ``links`` = (intra, inter) from
    ``Topology.links()``, ``flops`` from ``measure_matmul_flops`` or a timed step (taken as fully
    efficient), ``memory_bw_bytes_per_s`` from ``measure_memory_bandwidth``, ``collectives``
    from ``calibrate.fit_collectives``; ``overlap=False`` on a CPU backend and ``sync_loss`` from
    ``calibrate.measure_sync_loss`` (see ``Hardware``)."""
    intra, inter = links
    return Hardware(
        "measured",
        peak_flops=flops,
        memory_bytes=memory_bytes,
        memory_bw_bytes_per_s=memory_bw_bytes_per_s,
        devices_per_node=devices_per_node,
        intra=intra,
        inter=inter,
        matmul_efficiency=1.0,
        sources="measured by shardwise.topology.discover and matmul/copy calibrations",
        collectives=dict(collectives or {}),
        overlap=overlap,
        sync_loss=sync_loss,
        micro_batch_overhead_s=micro_batch_overhead_s,
    )

"""Topology facts and compute calibration on a CUDA device; skipped without one."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from shardwise.costmodel.hardware import hardware, measure_matmul_flops
from shardwise.topology import probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_gpu_model_bus_and_links():
    name, bus, links = probe.gpu_facts(0)
    assert name == torch.cuda.get_device_name(0)
    assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.0", bus)
    if shutil.which("nvidia-smi"):
        # nvidia-smi names a link (NV#, PIX, PXB, PHB, NODE, SYS) to every other GPU
        assert len(links) == torch.cuda.device_count() - 1
        assert all(re.fullmatch(r"NV\d+|PIX|PXB|PHB|NODE|SYS", k) for k in links.values())


def test_bf16_matmul_calibration_against_the_preset():
    flops = measure_matmul_flops("cuda", n=8192, dtype=torch.bfloat16)
    name = torch.cuda.get_device_name(0)
    if "H100" in name or "H200" in name:
        peak = hardware("h100x8-ib").peak_flops  # dense bf16, the same for H100 and H200 SXM
        assert 0.3 * peak < flops <= 1.05 * peak
    else:
        assert flops > 0

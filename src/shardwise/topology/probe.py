"""This rank's own place: node, CPUs, NUMA, GPU and the GPU's links (no communication)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import torch

from shardwise.comm import emulate

NVIDIA_SMI_TIMEOUT_S = 20.0


def node_name(rank: int, world_size: int, env: dict[str, str] | None = None) -> str:
    """An emulated node (``SHARDWISE_EMULATE_NODES``), else torchrun's ``GROUP_RANK``, else the
    host name."""
    env = dict(os.environ if env is None else env)
    if env.get(emulate.NODES_ENV):
        return f"node{emulate.parse_nodes(env[emulate.NODES_ENV], world_size)[rank]}"
    if "GROUP_RANK" in env:
        return f"node{int(env['GROUP_RANK'])}"
    return socket.gethostname()


def cpu_affinity() -> tuple[int, ...]:
    getter = getattr(os, "sched_getaffinity", None)
    return tuple(sorted(getter(0))) if getter else tuple(range(os.cpu_count() or 1))


def numa_nodes(
    cpus: tuple[int, ...], sysfs: Path = Path("/sys/devices/system/cpu")
) -> tuple[int, ...]:
    """NUMA nodes holding ``cpus`` (from sysfs; empty where it does not say)."""
    found = set()
    for c in cpus:
        folder = sysfs / f"cpu{c}"
        if folder.is_dir():
            for entry in folder.iterdir():
                m = re.fullmatch(r"node(\d+)", entry.name)
                if m:
                    found.add(int(m.group(1)))
    return tuple(sorted(found))


def gpu_facts(index: int) -> tuple[str, str, dict[str, str]]:
    """(model, PCI bus id, links by peer bus id) of CUDA device ``index``."""
    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if None in ids:  # a torch without the PCI fields: no bus id, so no links either
        return props.name, "", {}
    bus = f"{ids[0]:08x}:{ids[1]:02x}:{ids[2]:02x}.0".upper()
    return props.name, bus, nvidia_smi_links(bus)


def _smi(*args: str) -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        out = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout


def _normal_bus(bus: str) -> str:
    """``00000000:1B:00.0`` whatever the domain width nvidia-smi or torch used."""
    dom, _, rest = bus.strip().upper().partition(":")
    return f"{int(dom, 16):08X}:{rest}" if rest else bus.strip().upper()


def parse_topo_matrix(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m``'s GPU-to-GPU cells: ``{(i, j): "NV18" | "PIX" | "SYS" | ...}``."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return {}
    header = lines[0].split()
    gpus = [h for h in header if re.fullmatch(r"GPU\d+", h)]
    cells = {}
    for ln in lines[1:]:
        parts = ln.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]):
            continue
        i = int(parts[0][3:])
        for col, value in zip(gpus, parts[1 : 1 + len(gpus)]):
            j = int(col[3:])
            if i != j:
                cells[(i, j)] = value
    return cells


def nvidia_smi_links(bus: str) -> dict[str, str]:
    """Links from the GPU at ``bus`` to every other GPU, by peer bus id (empty without
    nvidia-smi)."""
    listing = _smi("--query-gpu=index,pci.bus_id", "--format=csv,noheader")
    index_of = {}
    for ln in listing.splitlines():
        if "," in ln:
            idx, pci = ln.split(",", 1)
            index_of[_normal_bus(pci)] = int(idx)
    me = index_of.get(_normal_bus(bus))
    if me is None:
        return {}
    cells = parse_topo_matrix(_smi("topo", "-m"))
    bus_of = {i: b for b, i in index_of.items()}
    return {bus_of[j]: kind for (i, j), kind in cells.items() if i == me and j in bus_of}

"""Topology values without ranks: the alpha-beta fit, islands (node and NVLink), the links a
collective prediction uses, JSON round trip, nvidia-smi parsing, the text report."""

from __future__ import annotations

import pytest

from shardwise.topology import LinkFit, RankInfo, Topology, fit_alpha_beta
from shardwise.topology.probe import numa_nodes, parse_topo_matrix
from shardwise.topology.report import draw_heatmap, format_topology


def test_fit_recovers_an_exact_line():
    sizes = [4096, 1 << 20, 4 << 20, 16 << 20]
    times = [1e-4 + s * 2e-9 for s in sizes]
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha_s == pytest.approx(1e-4)
    assert fit.beta_s_per_byte == pytest.approx(2e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.bandwidth_bytes_per_s == pytest.approx(5e8)


def test_fit_reports_a_poor_fit():
    fit = fit_alpha_beta([1, 2, 3, 4], [1.0, 4.0, 1.0, 4.0])
    assert fit.r2 < 0.5
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_alpha_beta([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        fit_alpha_beta([4, 8], [0.0, 2.0])


SMI = """\
        GPU0    GPU1    GPU2    GPU3    NIC0    CPU Affinity    NUMA Affinity
GPU0     X      NV18    SYS     SYS     PIX     0-47            0
GPU1    NV18     X      SYS     SYS     SYS     0-47            0
GPU2    SYS     SYS      X      NV18    SYS     48-95           1
GPU3    SYS     SYS     NV18     X      SYS     48-95           1
NIC0    PIX     SYS     SYS     SYS      X

Legend:
  X    = Self
"""


def test_nvidia_smi_matrix():
    cells = parse_topo_matrix(SMI)
    assert cells[(0, 1)] == "NV18" and cells[(0, 2)] == "SYS" and (0, 0) not in cells
    assert len(cells) == 12


def _topo(nodes: list[str], buses: list[str], links: list[dict[str, str]]) -> Topology:
    p = len(nodes)
    ranks = tuple(
        RankInfo(r, nodes[r], "h", r, (0,), (0,), f"cuda:{r}", "H100", buses[r], links[r])
        for r in range(p)
    )
    fast, slow = LinkFit(1e-5, 1e-11, 0.99), LinkFit(1e-4, 1e-10, 0.98)
    fits = tuple(
        tuple(None if i == j else (fast if nodes[i] == nodes[j] else slow) for j in range(p))
        for i in range(p)
    )
    samples = tuple(tuple(None if i == j else (1.0, 2.0) for j in range(p)) for i in range(p))
    return Topology(ranks, (4096, 8192), fits, samples)


def test_islands_and_links():
    buses = ["A", "B", "C", "D"]
    links = [{"B": "NV18", "C": "SYS"}, {"A": "NV18"}, {"D": "PIX"}, {"C": "PIX"}]
    topo = _topo(["n0", "n0", "n0", "n0"], buses, links)
    assert topo.islands() == {"node": [(0, 1, 2, 3)], "nvlink": [(0, 1), (2,), (3,)]}
    two = _topo(["n0", "n0", "n1", "n1"], buses, links)
    assert two.islands()["node"] == [(0, 1), (2, 3)]
    gl = two.links()
    assert gl.nodes == (0, 0, 1, 1)
    assert (gl.intra.alpha_s, gl.inter.alpha_s) == (1e-5, 1e-4)
    sub = two.links((2, 3))
    assert sub.nodes == (1, 1) and sub.inter == sub.intra


def test_json_round_trip_and_report(tmp_path):
    topo = _topo(["n0", "n1"], ["A", "B"], [{}, {}])
    topo.write_json(tmp_path / "t.json")
    assert Topology.read_json(tmp_path / "t.json") == topo
    text = format_topology(topo)
    assert "n0: ranks 0 | n1: ranks 1" in text and "R² of the fit (min 0.980)" in text
    assert draw_heatmap(topo, tmp_path / "t.png").stat().st_size > 0


def test_numa_from_sysfs(tmp_path):
    (tmp_path / "cpu0" / "node1").mkdir(parents=True)
    (tmp_path / "cpu1" / "node1").mkdir(parents=True)
    (tmp_path / "cpu2" / "node0").mkdir(parents=True)
    assert numa_nodes((0, 1, 2), tmp_path) == (0, 1)
    assert numa_nodes((5,), tmp_path) == ()

"""The inter-node link emulator's settings: parsing, node layouts, and which pairs it delays."""

from __future__ import annotations

import pytest

from shardwise.comm import emulate


def test_parse_link_units():
    link = emulate.parse_link("inter=alpha:200us,bw:0.1GB/s")
    assert link.alpha_s == pytest.approx(200e-6)
    assert link.bytes_per_s == pytest.approx(1e8)
    assert link.seconds(10**6) == pytest.approx(200e-6 + 0.01)
    assert emulate.parse_link("inter=bw:5MB/s,alpha:1.5ms").alpha_s == pytest.approx(1.5e-3)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("alpha:1ms,bw:1GB/s", "expected 'inter="),
        ("inter=alpha:1ms", "needs both"),
        ("inter=alpha:1h,bw:1GB/s", "bad alpha"),
        ("inter=alpha:1ms,bw:1Gb", "bad bw"),
        ("inter=alpha:1ms,lat:1GB/s", "bad field"),
        ("inter=alpha:1ms,bw:0GB/s", "must be > 0"),
    ],
)
def test_parse_link_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        emulate.parse_link(spec)


def test_nodes_from_the_environment():
    assert emulate.env_nodes(4, {"SHARDWISE_EMULATE_NODES": "0,0,1,1"}) == (0, 0, 1, 1)
    torchrun = {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert emulate.env_nodes(6, torchrun) == (0, 0, 1, 1, 2, 2)
    assert emulate.env_nodes(4, {}) is None
    with pytest.raises(ValueError, match="one node id"):
        emulate.env_nodes(3, {"SHARDWISE_EMULATE_NODES": "0,1"})


def test_only_inter_node_pairs_wait():
    emu = emulate.Emulator(emulate.LinkDelay(1e-3, 1e6), (0, 0, 1, 1))
    assert emu.delay_s(0, 1, 10**6) == 0.0
    assert emu.delay_s(1, 2, 10**6) == pytest.approx(1.001)


def test_link_without_nodes_is_refused(monkeypatch):
    monkeypatch.setenv(emulate.LINK_ENV, "inter=alpha:1ms,bw:1GB/s")
    for name in (emulate.NODES_ENV, "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="nodes are unknown"):
        emulate.active(4)

"""A blocked split (a fused q|k|v) gathered back whole: each rank's piece of every block,
all_gathered over its axes, comes back in the whole tensor's order [q | k | v] (what the export
and the full state dicts write), over one axis and over two nested axes (world 4)."""

from __future__ import annotations

import torch

from shardwise.mesh import Axis, Mesh
from shardwise.parallel.placement import Placement, Shard
from shardwise.testing import run_on_ranks


def _gather_back() -> list[bool]:
    mesh = Mesh(dp=2, tp=2)
    whole = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))
    split = Shard(1, blocks=3)
    cases = [
        Placement.on(mesh, "qkv.weight", whole.shape, {Axis.TP: split}),
        Placement.on(mesh, "qkv.weight", whole.shape, {Axis.DP_SHARD: split, Axis.TP: split}),
        Placement.on(mesh, "qkv.bias", (24,), {Axis.TP: Shard(0, blocks=3)}),
    ]
    out = []
    for where in cases:
        full = whole if len(where.full_shape) == 2 else whole[0]
        local = where.shard_of(full)
        assert local.shape == where.local_shape()
        out.append(torch.equal(where.gather_full(local, mesh.group), full))
    return out


def test_blocked_pieces_gather_back_in_block_order():
    rows = run_on_ranks(4, _gather_back, timeout_s=120)
    assert rows == [[True, True, True]] * 4

"""Ending a world destroys torch's groups for good (#22): their gloo threads are joined before
``shutdown()`` returns (none is left to the interpreter's teardown, where it can abort the
process), the world's groups refuse further use, and a torch group still held elsewhere is named
in a warning."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

import shardwise

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def gloo_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that just ended
            pass
    return sum(n.startswith(("pt_gloo", "gloo_tcp")) for n in names)


def test_shutdown_joins_the_gloo_threads_and_the_groups_refuse_use():
    before = gloo_threads()
    world = shardwise.init(backend="gloo")
    group = world.new_group([0], name="solo")
    shardwise.all_reduce(torch.ones(2))
    assert gloo_threads() > before  # the world's group runs its worker threads
    shardwise.shutdown()
    assert gloo_threads() == before
    for g in (world.group, group):
        with pytest.raises(RuntimeError, match=r"its world has ended .* call shardwise\.init"):
            _ = g.pg
    assert world.pg is None


def test_a_torch_group_still_held_elsewhere_is_named_in_a_warning(caplog):
    world = shardwise.init(backend="gloo")
    held = world.pg  # what a user's script should not keep
    assert held is not None
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        shardwise.shutdown()
    assert (
        f"rank 0: torch's process group {held.group_name} is still referenced 1 times outside "
        "shardwise after leaving it"
    ) in caplog.text

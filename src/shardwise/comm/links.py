"""A group's measured links for the public ``all_reduce(..., algorithm="auto")`` called without
``links=``: measured once per group and kept on its world.

Measuring is ``shardwise.topology.discover``, which sits above ``comm`` (it talks through it),
so ``comm`` cannot import it: the package that composes both hands it over once
(``use_discovery``, done by ``shardwise/__init__.py``).

Discovery is collective: the first such call on a group runs it on every rank of the group
(each rank makes that call anyway, as for any collective) and takes seconds (ping-pong between
every pair of ranks); later calls on a group of the same ranks reuse the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from shardwise.comm import emulate
from shardwise.comm.allreduce_rounds import GroupLinks
from shardwise.comm.groups import Group

NEEDS_LINKS = ("auto", "hierarchical")
"""Algorithms that read the group's links (hierarchical only its nodes)."""


class LinkModel(Protocol):
    """What discovery returns: the links of the group it measured (``Topology``)."""

    def links(self, ranks: tuple[int, ...] | None = None) -> GroupLinks: ...


Discover = Callable[[Group], LinkModel]

_discover: Discover | None = None


def use_discovery(discover: Discover) -> None:
    """Measure groups with ``discover`` (collective over the group it is given)."""
    global _discover
    _discover = discover


def measured(g: Group) -> GroupLinks:
    """``g``'s links from its world's cache, measured first if they are not there."""
    cache = g.world.measured_links
    if g.ranks not in cache:
        if _discover is None:
            raise RuntimeError(
                "all_reduce: no link discovery is set up; import shardwise (it sets "
                "shardwise.topology.discover) or pass links="
            )
        cache[g.ranks] = _discover(g).links()
    return cache[g.ranks]


def fill_in(g: Group, kwargs: dict[str, Any]) -> None:
    """For the public ``all_reduce``: without ``links=``, ``"auto"`` gets the group's measured
    links, and ``"hierarchical"`` too where neither ``nodes=`` nor the environment says which
    node each rank is on."""
    algorithm = kwargs.get("algorithm", "native")
    if algorithm not in NEEDS_LINKS or kwargs.get("links") is not None:
        return
    if algorithm == "hierarchical" and (
        kwargs.get("nodes") is not None or emulate.env_nodes(g.world.world_size) is not None
    ):
        return
    kwargs["links"] = measured(g)

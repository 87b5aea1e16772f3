"""Where ranks run and how fast they talk: ``discover(group)`` measures it, ``Topology`` holds
it (islands, the alpha-beta fit of every link, the model the collective algorithms use)."""

from shardwise.topology.discover import discover, local_info
from shardwise.topology.measure import DEFAULT_SIZES, fit_alpha_beta, measure_links
from shardwise.topology.model import LinkFit, RankInfo, Topology

__all__ = [
    "DEFAULT_SIZES",
    "LinkFit",
    "RankInfo",
    "Topology",
    "discover",
    "fit_alpha_beta",
    "local_info",
    "measure_links",
]

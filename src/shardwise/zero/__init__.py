"""ZeRO: partitioning optimizer states, gradients and parameters over a data-parallel group."""

from shardwise.zero.stage import ZeroStage

__all__ = ["ZeroStage"]

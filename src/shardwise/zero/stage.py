"""A ZeRO stage as data: what is partitioned over the data-parallel group.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
section 5: stage 1 partitions optimizer states (P_os), stage 2 adds gradients (P_os+g), stage 3
adds parameters (P_os+g+p). Stage 0 is plain data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ZeroStage:
    """What this stage shards. Code reads these flags, never the stage number."""

    stage: int
    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @property
    def reduce_every_micro_step(self) -> bool:
        """Full gradients are not kept between micro-steps, so each one is reduced at once."""
        return self.shard_grads

    @property
    def gather_after_step(self) -> bool:
        """Parameters are replicated, so the updated shards are all-gathered after the step."""
        return self.shard_optimizer and not self.shard_params

    @staticmethod
    def of(stage: int) -> ZeroStage:
        if stage not in STAGES:
            raise ValueError(f"zero_stage must be one of {STAGES}, got {stage!r}")
        return ZeroStage(stage, stage >= 1, stage >= 2, stage >= 3)

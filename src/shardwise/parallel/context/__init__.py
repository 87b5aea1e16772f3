"""Context parallelism: long sequences split over the mesh's ``cp`` axis, exact attention.

``layout`` (which tokens each rank holds: load-balanced chunks), ``blocks`` (block attention
and the log-sum-exp merge), ``ring`` and ``all_to_all`` (the two exact attentions over cp),
``attention`` (a model's ``ContextParallel`` record: batch split, attention, loss), ``apply``
(the plan styles that give a model's modules context parallelism from outside).
"""

from shardwise.parallel.context.apply import STYLES, apply_context_parallel
from shardwise.parallel.context.attention import METHODS, ContextParallel
from shardwise.parallel.context.layout import SequenceLayout

__all__ = ["METHODS", "STYLES", "ContextParallel", "SequenceLayout", "apply_context_parallel"]

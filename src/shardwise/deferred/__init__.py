"""Models built on the meta device made real one piece at a time, each rank only what it keeps
(``init``), with the values an eager build gives them (``eager_replay``, checked op by op with
``op_record``); ``peak`` counts what a rank holds meanwhile. The engine fills its shards
through it; ``parallelize`` makes a pipeline stage real through it."""

from shardwise.deferred.init import InitFn, deferred_init, materialize_kept, target_device

__all__ = ["InitFn", "deferred_init", "materialize_kept", "target_device"]

"""``shardwise train``'s per-rank side: the training loop, its metrics, progress and reports.

``options`` (what a run does), ``rundir`` (where its files go), ``loop`` and ``worker`` (what
each rank runs), ``metrics`` / ``summary`` (what it records), ``progress`` (what rank 0 shows),
``checkpoints`` (what it saves), ``report`` / ``plots`` (what ``shardwise report`` draws).
"""

"""The ``shardwise`` command line: parses options and launches ranks, nothing more."""

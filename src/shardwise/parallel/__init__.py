"""Parallel layouts: how the ranks of a run are split into data, tensor and pipeline parallelism."""

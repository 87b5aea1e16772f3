"""Parallelism applied to a model from outside: where each parameter lives (``placement``),
tensor and sequence parallelism (``tensor``), pipeline parallelism (``pipeline``)."""

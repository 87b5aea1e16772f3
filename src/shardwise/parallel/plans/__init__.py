"""Ready-made parallel plans, beside the parallelism they drive: ``gpt`` (the built-in GPT:
tensor, sequence and pipeline parallelism in one recipe), ``llama`` (Hugging Face Llama naming,
tensor and sequence parallelism) and ``gpt2`` (Hugging Face GPT-2 naming, tensor parallelism)."""

from shardwise.parallel.plans import gpt, gpt2, llama

__all__ = ["gpt", "gpt2", "llama"]

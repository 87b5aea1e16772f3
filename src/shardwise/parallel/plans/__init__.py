"""Ready-made parallel plans, beside the parallelism they drive: ``gpt`` (the built-in GPT:
tensor, sequence and pipeline parallelism in one recipe) and ``llama`` (Hugging Face Llama
naming, tensor and sequence parallelism)."""

from shardwise.parallel.plans import gpt, llama

__all__ = ["gpt", "llama"]

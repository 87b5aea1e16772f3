"""Models shardwise trains. They hold no distributed logic; parallelism is applied from outside."""

from shardwise.models.gpt import GPT, MLP, MODEL_SIZES, Block, CausalSelfAttention, GPTConfig

__all__ = ["GPT", "MLP", "MODEL_SIZES", "Block", "CausalSelfAttention", "GPTConfig"]

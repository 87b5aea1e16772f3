"""Tiny Hugging Face models built from configs (nothing downloaded), for the hf I/O tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def tiny_llama(tie: bool = False, seed: int = 0, layers: int = 2):  # -> LlamaForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0, vocab: int = VOCAB):  # -> GPT2LMHeadModel (ties lm_head to wte)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def save(model, path: Path, max_shard_size: str | int = "50GB") -> Path:
    """``save_pretrained`` with safetensors; a small ``max_shard_size`` gives several files."""
    model.save_pretrained(path, max_shard_size=max_shard_size, safe_serialization=True)
    return path


def tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 9), generator=g)


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits

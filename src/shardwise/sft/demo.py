"""A fine-tuning setup built offline, for the demo and the tests: a byte-level BPE tokenizer
trained on generated sentences, prompt/completion and chat datasets, and a tiny Llama or GPT-2
saved with ``save_pretrained`` (nothing downloaded)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from shardwise.sft.tokenizer import build_tokenizer

WORDS = (
    "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jolly "
    "mountain of books about rivers stars and small green apples"
).split()


def sentence(i: int, n: int) -> str:
    """The ``i``-th generated sentence of ``n`` words."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def prompt_records(count: int = 24) -> list[dict[str, Any]]:
    """``count`` prompt/completion records."""
    return [
        {
            "prompt": f"Q: {sentence(i, 2 + i % 4)}? A:",
            "completion": " " + sentence(i + 5, 1 + i % 5),
        }
        for i in range(count)
    ]


def chat_records(count: int = 24) -> list[dict[str, Any]]:
    """``count`` chat records (some with a system turn, some with two exchanges)."""
    out = []
    for i in range(count):
        turns = [
            {"role": "user", "content": sentence(i, 2 + i % 3)},
            {"role": "assistant", "content": sentence(i + 3, 1 + i % 4)},
        ]
        if i % 3 == 0:
            turns += [
                {"role": "user", "content": sentence(i + 1, 2)},
                {"role": "assistant", "content": sentence(i + 9, 3)},
            ]
        if i % 4 == 0:
            turns.insert(0, {"role": "system", "content": "be brief"})
        out.append({"messages": turns})
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    """Write ``records`` one JSON object a line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@functools.lru_cache(maxsize=2)
def tokenizer(chat: bool = True) -> Any:
    """A 320-token BPE tokenizer trained on the generated sentences (ChatML template)."""
    corpus = [sentence(i, 12) for i in range(200)] + ["user assistant system Q: A: ?"] * 20
    return build_tokenizer(corpus, vocab_size=320, chat=chat)


def tiny_llama(vocab: int, seed: int = 0) -> Any:
    """A two-layer ``LlamaForCausalLM`` (grouped-query attention), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg)


def tiny_gpt2(vocab: int, seed: int = 0) -> Any:
    """A two-layer ``GPT2LMHeadModel`` without dropout, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(cfg)


def model_dir(root: Path, kind: str) -> Path:
    """A model directory (config, safetensors, tokenizer) of the tiny ``kind`` model."""
    tok = tokenizer()
    model = (tiny_llama if kind == "llama" else tiny_gpt2)(len(tok))
    out = root / kind
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


DEMO_LORA = "r=8,alpha=16,dropout=0.0,targets=q_proj,v_proj"
"""``shardwise finetune --demo``'s adapters unless ``--lora`` / ``--full`` says otherwise."""


def corpus_tokenizer(max_bytes: int = 300_000) -> Any:
    """A 512-token BPE tokenizer (ChatML template) trained on the bundled corpus's text
    (``shardwise.data.load_corpus``, its first ``max_bytes`` bytes) and the demo sentences."""
    from shardwise.data import load_corpus

    raw = bytes(load_corpus(max_bytes=max_bytes).train.tolist()).decode("utf-8", "replace")
    texts = [line for line in raw.splitlines() if line.strip()]
    texts += [sentence(i, 12) for i in range(200)]
    return build_tokenizer(texts, vocab_size=512, chat=True)


def write_demo(root: Path) -> tuple[Path, Path]:
    """Write ``root/model`` (a tiny Llama and a tokenizer trained on the bundled corpus) and
    ``root/train.jsonl`` (instruction records: chat and prompt/completion); returns both."""
    root.mkdir(parents=True, exist_ok=True)
    tok = corpus_tokenizer()
    out = root / "model"
    tiny_llama(len(tok)).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    data = write_jsonl(root / "train.jsonl", chat_records(32) + prompt_records(32))
    return out, data

"""A small byte-level BPE tokenizer trained offline on given text, with a chat template: for
tests, the demo, and anyone who needs a Hugging Face tokenizer without downloading one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML: each turn ``<|im_start|>role\\ncontent<|im_end|>\\n``."""

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
"""Ids 0-4 of every tokenizer built here: pad, bos, eos and the chat markers."""


def build_tokenizer(texts: Iterable[str], vocab_size: int = 256, *, chat: bool = True) -> Any:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE of ``vocab_size`` tokens trained on
    ``texts``; pad ``<pad>``, bos ``<s>``, eos ``</s>``; ChatML template unless ``chat`` is
    False). Deterministic for the same texts. Needs ``tokenizers`` and ``transformers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast

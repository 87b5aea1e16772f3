"""Examples to token ids and labels: what the model reads and which tokens the loss is on.

Labels follow Hugging Face's convention: aligned with the inputs (the model shifts them), and
``IGNORE`` (-100) where no loss is taken. Text and completions end with the tokenizer's end of
sequence token, so the model learns to stop. A ``messages`` example is rendered with the
tokenizer's own chat template; the assistant spans are found by rendering each prefix of the
conversation (with the generation prompt) and taking the characters each assistant turn adds,
then every token of the whole rendering whose first character lies in such a span is labelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.sft.data import DataError, Example

IGNORE = -100
"""The label of a token without loss (``torch.nn.functional.cross_entropy``'s default)."""


@dataclass(frozen=True)
class Tokenized:
    """One example's token ids and labels (same length; ``IGNORE`` where no loss is taken)."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def check_tokenizer(tokenizer: Any, needs_chat: bool) -> None:
    """Raise ``DataError`` when ``tokenizer`` cannot render the data: no chat template for
    ``messages`` examples, or no pad / end-of-sequence token to pad with."""
    if needs_chat and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the data has 'messages' records but the tokenizer has no chat template: add one "
            "(chat_template in tokenizer_config.json or chat_template.jinja) or use "
            "prompt/completion records"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("the tokenizer must be a fast tokenizer (tokenizer.json)")
    if pad_id(tokenizer) is None:
        raise DataError("the tokenizer has neither a pad token nor an end-of-sequence token")


def pad_id(tokenizer: Any) -> int | None:
    """The token padding uses: the pad token, else the end-of-sequence token."""
    pid = tokenizer.pad_token_id
    return int(pid) if pid is not None else tokenizer.eos_token_id


def _with_eos(ids: list[int], tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def render(example: Example, tokenizer: Any, *, train_on_prompt: bool = False) -> Tokenized:
    """Token ids and labels of ``example``: loss on everything for text, on the completion /
    assistant turns otherwise (on every token with ``train_on_prompt``)."""
    if example.kind == "messages":
        return _render_messages(example, tokenizer, train_on_prompt)
    if example.kind == "text":
        assert example.text is not None
        ids = _with_eos(tokenizer(example.text)["input_ids"], tokenizer)
        return Tokenized(ids, list(ids))
    assert example.prompt is not None and example.completion is not None
    prompt = tokenizer(example.prompt)["input_ids"]
    completion = tokenizer(example.completion, add_special_tokens=False)["input_ids"]
    completion = _with_eos(completion, tokenizer)
    head = list(prompt) if train_on_prompt else [IGNORE] * len(prompt)
    return Tokenized(prompt + completion, head + completion)


def _chat(tokenizer: Any, turns: tuple[tuple[str, str], ...], generation: bool) -> str:
    messages = [{"role": r, "content": c} for r, c in turns]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    assert isinstance(text, str)
    return text


def assistant_spans(tokenizer: Any, turns: tuple[tuple[str, str], ...]) -> list[tuple[int, int]]:
    """Character spans of the rendered conversation that the assistant turns add (their
    content and end-of-turn markup). ``DataError`` when the template does not render each
    prefix of the conversation as a prefix of the whole."""
    full = _chat(tokenizer, turns, generation=False)
    spans = []
    for i, (role, _) in enumerate(turns):
        if role != "assistant":
            continue
        before = _chat(tokenizer, turns[:i], generation=True) if i else ""
        upto = _chat(tokenizer, turns[: i + 1], generation=False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(
                "the chat template does not render a conversation's prefix as the prefix of "
                "its rendering, so assistant turns cannot be located: pass --train-on-prompt "
                "or use prompt/completion records"
            )
        spans.append((len(before), len(upto)))
    return spans


def _render_messages(example: Example, tokenizer: Any, train_on_prompt: bool) -> Tokenized:
    assert example.messages is not None
    full = _chat(tokenizer, example.messages, generation=False)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    if train_on_prompt:
        return Tokenized(ids, list(ids))
    spans = assistant_spans(tokenizer, example.messages)
    labels = [
        t if any(a <= start < b for a, b in spans) else IGNORE
        for t, (start, _) in zip(ids, enc["offset_mapping"])
    ]
    return Tokenized(ids, labels)

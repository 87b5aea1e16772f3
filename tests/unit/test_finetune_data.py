"""Fine-tuning data: reading and validation, label masking token by token, packing that never
lets examples see each other, and the resumable per-epoch order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.sft.collator import Collator, nll_sum
from shardwise.sft.data import DataError, Example, read_dataset
from shardwise.sft.demo import (
    chat_records,
    prompt_records,
    tiny_gpt2,
    tiny_llama,
    tokenizer,
    write_jsonl,
)
from shardwise.sft.packing import block_causal_mask, pack, pack_rows, prepare
from shardwise.sft.render import IGNORE, Tokenized, render
from shardwise.sft.sampler import ExampleSampler

# ---- reading ----


def test_a_malformed_line_names_file_line_and_what_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: line 3 has 'prompt' but no 'completion'"):
        read_dataset(path)
    path.write_text('{"text": "a"}\nnot json\n{"text": 3}\n{"text": "b"}\n')
    data = read_dataset(path, skip_bad_lines=True)
    assert (len(data), data.skipped) == (2, 2)
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        read_dataset(path)


@pytest.mark.parametrize(
    ("record", "what"),
    [
        ({"text": "a", "prompt": "b"}, "mixes the fields"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\] has no string 'content'"),
        ({"other": 1}, "has none of the fields"),
    ],
)
def test_each_bad_record_says_what_is_wrong(tmp_path: Path, record: dict, what: str) -> None:
    with pytest.raises(DataError, match=what):
        read_dataset(write_jsonl(tmp_path / "d.jsonl", [record]))


def test_json_lists_empty_files_and_parquet(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text(json.dumps(prompt_records(3)))
    assert len(read_dataset(tmp_path / "d.json")) == 3
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no example"):
        read_dataset(tmp_path / "e.jsonl")
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="convert it to JSONL"):
        read_dataset(tmp_path / "p.parquet")


# ---- masking ----


def test_prompt_completion_labels_only_the_completion_and_eos() -> None:
    tok = tokenizer()
    ex = Example(prompt="Q: the fox? A:", completion=" lazy dog")
    out = render(ex, tok)
    n_prompt = len(tok("Q: the fox? A:")["input_ids"])
    assert out.labels[:n_prompt] == [IGNORE] * n_prompt
    assert out.labels[n_prompt:] == out.input_ids[n_prompt:]
    assert tok.decode(out.input_ids[n_prompt:]) == " lazy dog</s>"
    assert render(ex, tok, train_on_prompt=True).labels == out.input_ids


def _independent_chat_labels(tok, turns: list[dict]) -> tuple[list[int], list[int]]:
    """Labels from the ChatML structure itself: the characters of each assistant turn's
    content and its closing ``<|im_end|>\\n``, located by walking the rendered string."""
    text = tok.apply_chat_template(turns, tokenize=False)
    spans, cursor = [], 0
    for t in turns:
        head = f"<|im_start|>{t['role']}\n"
        start = text.index(head, cursor) + len(head)
        end = start + len(t["content"]) + len("<|im_end|>\n")
        assert text[start:end] == t["content"] + "<|im_end|>\n"
        if t["role"] == "assistant":
            spans.append((start, end))
        cursor = end
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        i if any(a <= s < b for a, b in spans) else IGNORE
        for i, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    return enc["input_ids"], labels


def test_chat_labels_equal_an_independent_masking_token_by_token() -> None:
    tok = tokenizer()
    for record in chat_records(12):
        ex = read_record(record)
        out = render(ex, tok)
        ids, labels = _independent_chat_labels(tok, record["messages"])
        assert out.input_ids == ids
        assert out.labels == labels
        learned = tok.decode([t for t in out.labels if t != IGNORE])
        assistant = [
            m["content"] + "<|im_end|>\n" for m in record["messages"] if m["role"] == "assistant"
        ]
        assert learned == "".join(assistant)


def read_record(record: dict) -> Example:
    from shardwise.sft.data import parse_record

    return parse_record(record)


def test_messages_without_a_chat_template_are_refused() -> None:
    from shardwise.sft.render import check_tokenizer

    with pytest.raises(DataError, match="no chat template"):
        check_tokenizer(tokenizer(chat=False), needs_chat=True)


def test_truncation_is_counted_and_unlearnable_examples_dropped() -> None:
    long = Tokenized(list(range(10)), [IGNORE] * 6 + list(range(6, 10)))
    short = Tokenized([1, 2, 3], [IGNORE, 2, 3])
    out = prepare([long, short], seq_len=5)
    assert (out.truncated, out.dropped) == (1, 1)
    assert out.examples == [short]


# ---- packing ----


def test_pack_restarts_positions_and_masks_each_boundary() -> None:
    a, b = Tokenized([5, 6, 7], [5, 6, 7]), Tokenized([8, 9], [IGNORE, 9])
    row = pack([a, b], seq_len=7, pad_id=0)
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9, 0, 0]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert row.labels.tolist() == [IGNORE, 6, 7, IGNORE, 9, IGNORE, IGNORE]
    mask = block_causal_mask(row.segments[None])[0, 0].int()
    expected = torch.zeros(7, 7, dtype=torch.int)
    expected[:3, :3] = torch.ones(3, 3).tril()
    expected[3:5, 3:5] = torch.ones(2, 2).tril()
    expected[5, 5] = expected[6, 6] = 1
    assert torch.equal(mask, expected)
    assert pack_rows([3, 2, 4, 1], [0, 1, 2, 3], seq_len=5) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_packed_rows_equal_each_example_alone(build) -> None:
    """The packed loss sum equals the examples' losses computed one by one, and changing one
    example's tokens leaves its row-mates' logits exactly as they were."""
    tok = tokenizer()
    model = build(len(tok)).eval()
    examples = [render(read_record(r), tok) for r in prompt_records(6)]
    prepared = prepare(examples, seq_len=64).examples
    rows = pack_rows([len(e) for e in prepared], list(range(len(prepared))), 64)
    assert any(len(r) > 1 for r in rows)
    batch = Collator(prepared, 0, packing=True, seq_len=64)(rows)
    with torch.no_grad():
        packed = nll_sum(model(**batch.model_inputs()).logits, batch.labels)
        alone = sum(
            nll_sum(model(input_ids=torch.tensor([e.input_ids])).logits, torch.tensor([e.labels]))
            for e in prepared
        )
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
        # change the first example of the first row: every later token's logits stay
        first = len(prepared[rows[0][0]])
        inputs = batch.model_inputs()
        before = model(**inputs).logits[0, first:]
        inputs["input_ids"] = inputs["input_ids"].clone()
        inputs["input_ids"][0, :first] = 7
        after = model(**inputs).logits[0, first:]
    assert torch.equal(before, after)


def test_nll_sum_is_each_labelled_next_token_loss_summed() -> None:
    """Position t is scored against label t + 1, IGNORE skipped; its gradient equals the one of
    the same sum written out token by token (and the last position, predicting nothing, gets
    none)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7), generator=gen)
    labels[0, :3] = IGNORE
    labels[1, 5] = IGNORE
    got = nll_sum(logits, labels)
    (grad,) = torch.autograd.grad(got, logits)
    terms = [
        -torch.log_softmax(logits[r, t], dim=-1)[labels[r, t + 1]]
        for r in range(2)
        for t in range(6)
        if labels[r, t + 1] != IGNORE
    ]
    want = torch.stack(terms).sum()
    (want_grad,) = torch.autograd.grad(want, logits)
    assert len(terms) == 9  # row 0: labels 3-6; row 1: labels 1-6 but 5
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
    assert not grad[:, -1].any()


# ---- order ----


def test_sampler_resumes_exactly_and_dp_slices_cover_the_global_batch() -> None:
    lengths = [3, 5, 2, 7, 4, 1, 6, 2, 3]

    def rows_of(order: list[int]) -> list[list[int]]:
        return pack_rows(lengths, order, 8)

    def make(rank: int = 0, size: int = 1) -> ExampleSampler:
        return ExampleSampler(9, 2, rank, size, seed=3, grad_accum=2, rows_of=rows_of)

    whole = make()
    seen = [whole.next_batch() for _ in range(12)]  # several epochs
    assert whole.epoch >= 2 and whole.rows(0) != whole.rows(1)
    resumed = make()
    for _ in range(5):
        resumed.next_batch()
    state = json.loads(json.dumps(resumed.state_dict()))
    again = make()
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(7)] == seen[5:]
    # two dp ranks at micro-batch 2, accumulation 2: their steps are the global batch, split
    one = ExampleSampler(9, 2, 0, 1, seed=3, grad_accum=4, rows_of=rows_of)
    ranks = [make(r, 2) for r in range(2)]
    for _ in range(3):
        expected = one.global_batch()
        got = [row for s in ranks for _ in range(2) for row in s.next_batch()]
        assert got == expected
        for _ in range(4):
            one.next_batch()
    with pytest.raises(ValueError, match="num_examples"):
        ExampleSampler(8, 2, 0, 1, seed=3).load_state_dict(state)

"""shardwise fine-tuning at 2 ranks equals a plain transformers loop in one process: same data
order, fp32, losses per step within rtol 1e-5, for LoRA and full fine-tuning, ZeRO-3 and
dp1 x tp2, prompt/completion and chat data, padded and packed."""

from __future__ import annotations

from pathlib import Path

import finetune_cases as fc
import pytest

from shardwise.sft.demo import chat_records, model_dir, prompt_records, write_jsonl
from shardwise.testing import run_on_ranks

pytest.importorskip("peft")
LORA = "r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj"
GPT2_LORA = "r=4,alpha=8,dropout=0.0,targets=c_attn"
TP_LORA = "r=4,alpha=8,dropout=0.0,targets=q_proj,k_proj,v_proj,o_proj,up_proj,down_proj,lm_head"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ft")
    return {
        "llama": model_dir(root, "llama"),
        "gpt2": model_dir(root, "gpt2"),
        "prompt": write_jsonl(root / "prompt.jsonl", prompt_records(24)),
        "chat": write_jsonl(root / "chat.jsonl", chat_records(24)),
    }


@pytest.mark.parametrize(
    ("kind", "data", "lora", "packing"),
    [
        ("llama", "prompt", LORA, False),
        ("llama", "chat", None, False),
        ("llama", "chat", LORA, True),
        ("gpt2", "prompt", None, True),
        ("gpt2", "chat", GPT2_LORA, False),
    ],
)
def test_zero3_at_two_ranks_equals_transformers(dirs, kind, data, lora, packing) -> None:
    args = (str(dirs[kind]), str(dirs[data]), lora)
    got = run_on_ranks(2, fc.engine_losses, *args, packing=packing, timeout_s=300)
    want, _ = fc.reference_losses(*args, packing=packing)
    assert got[0] == got[1]
    assert got[0] != pytest.approx(got[0][0])  # the steps moved the weights
    assert got[0] == pytest.approx(want, rel=1e-5)


def test_full_finetune_dp1_tp2_equals_transformers(dirs) -> None:
    args = (str(dirs["llama"]), str(dirs["chat"]), None)
    got = run_on_ranks(2, fc.engine_losses, *args, tp=2, zero=0, accum=4, timeout_s=300)
    want, _ = fc.reference_losses(*args, dp=1, accum=4)
    assert got[0] == pytest.approx(want, rel=1e-5)


def test_lora_dp1_tp2_equals_transformers(dirs) -> None:
    """Adapters on every split layer of the plan: A whole and B column-split on q, k, v, gate
    and up; A row-split and B whole on o and down; lm_head's B split and gathered."""
    _tp2_equals_transformers(str(dirs["llama"]), str(dirs["chat"]), TP_LORA)


@pytest.mark.parametrize("lora", [None, "r=4,alpha=8,dropout=0.0,targets=c_fc,c_proj"])
def test_gpt2_dp1_tp2_equals_transformers(dirs, lora) -> None:
    """GPT-2's plan: the fused c_attn split by heads of q, k and v, the Conv1D layers split
    along their stored [in, out] dims, the tied head over a padded vocabulary split; LoRA on
    the Conv1D layers split with their bases."""
    _tp2_equals_transformers(str(dirs["gpt2"]), str(dirs["chat"]), lora)


def _tp2_equals_transformers(*args: str | None) -> None:
    """Both tp ranks' losses over 4 accumulated micro-batches equal transformers' (rel 1e-5)
    and change from step to step."""
    got = run_on_ranks(2, fc.engine_losses, *args, tp=2, zero=0, accum=4, timeout_s=300)
    want, _ = fc.reference_losses(*args, dp=1, accum=4)
    assert got[0] == got[1]
    assert got[0] != pytest.approx(got[0][0])
    assert got[0] == pytest.approx(want, rel=1e-5)


@pytest.mark.long
def test_lora_dp2_tp2_zero3_equals_transformers(dirs) -> None:
    args = (str(dirs["llama"]), str(dirs["prompt"]), TP_LORA)
    got = run_on_ranks(4, fc.engine_losses, *args, tp=2, zero=3, timeout_s=300)
    want, _ = fc.reference_losses(*args, dp=2)
    assert all(g == got[0] for g in got)
    assert got[0] == pytest.approx(want, rel=1e-5)


def test_lora_on_the_vocab_embedding_under_tp_is_refused_in_one_line(dirs) -> None:
    from shardwise.testing import RankError

    lora = "r=4,alpha=8,dropout=0.0,targets=embed_tokens,q_proj"
    with pytest.raises(RankError, match="'model.embed_tokens' carries LoRA adapters, but its "):
        run_on_ranks(2, fc.engine_losses, str(dirs["llama"]), str(dirs["prompt"]), lora, tp=2)


def test_lora_at_zero1_equals_transformers(dirs) -> None:
    """Stages 0-2 keep the frozen base outside the flat buffers (made real from the meta
    build, then streamed)."""
    args = (str(dirs["llama"]), str(dirs["prompt"]), LORA)
    got = run_on_ranks(2, fc.engine_losses, *args, zero=1, timeout_s=300)
    want, _ = fc.reference_losses(*args)
    assert got[0] == pytest.approx(want, rel=1e-5)

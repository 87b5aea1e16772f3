"""Text from a fine-tuning run or a Hugging Face model directory, on the CPU, with the
directory's tokenizer (its chat template for ``chat``) and the model's generation config.

A run directory gives its newest weights: ``model/`` (full or merged), else ``adapter/`` on
the base, else its newest checkpoint (a LoRA checkpoint holds the adapters only, so the base
comes from the run's model directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_DIR = "adapter"
"""Under a fine-tuning run directory: the LoRA adapter ``PeftModel.from_pretrained`` loads."""
MODEL_DIR = "model"
"""Under a fine-tuning run directory: the full (or merged) model ``from_pretrained`` loads."""


@dataclass
class Loaded:
    """A model ready to generate, its tokenizer, and where its weights came from."""

    model: Any
    tokenizer: Any
    source: str


def finetune_options(path: Path) -> dict[str, Any] | None:
    """The ``finetune`` options of a fine-tuning run directory; None for anything else."""
    config = path / "config.json"
    if not config.is_file():
        return None
    found = json.loads(config.read_text()).get("finetune")
    return found if isinstance(found, dict) else None


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (a config naming a model type)."""
    config = path / "config.json"
    return config.is_file() and "model_type" in json.loads(config.read_text())


def _from_checkpoint(run: Path, ft: dict[str, Any]) -> Loaded:
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint import CheckpointError, CheckpointReader
    from shardwise.checkpoint.tools import read_consolidated
    from shardwise.sft.lora import LoraSpec, apply_lora
    from shardwise.sft.model import load_tokenizer

    base_dir = Path(ft["model_dir"])
    try:
        with CheckpointReader(run / "checkpoints", verify=False) as reader:
            step_dir = reader.path
    except (CheckpointError, FileNotFoundError):
        raise ValueError(
            f"{run} holds no {MODEL_DIR}/, {ADAPTER_DIR}/ nor checkpoint yet: nothing to "
            "generate with"
        ) from None
    model: Any = AutoModelForCausalLM.from_pretrained(base_dir)
    if ft.get("lora"):
        model = apply_lora(model, LoraSpec.parse(ft["lora"]))
    state = read_consolidated(step_dir)
    model.load_state_dict(state, strict=not ft.get("lora"))
    return Loaded(model, load_tokenizer(base_dir), str(step_dir))


def load(path: Path) -> Loaded:
    """The model and tokenizer of a fine-tuning run directory or a model directory (see the
    module docstring); ValueError for anything else."""
    from transformers import AutoModelForCausalLM

    from shardwise.sft.model import check_model_dir, load_tokenizer

    ft = finetune_options(path)
    if ft is None:
        check_model_dir(path)
        return Loaded(AutoModelForCausalLM.from_pretrained(path), load_tokenizer(path), str(path))
    if (path / MODEL_DIR).is_dir():
        out = path / MODEL_DIR
        return Loaded(AutoModelForCausalLM.from_pretrained(out), load_tokenizer(out), str(out))
    if (path / ADAPTER_DIR).is_dir():
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(Path(ft["model_dir"]))
        model = PeftModel.from_pretrained(base, path / ADAPTER_DIR)
        return Loaded(model, load_tokenizer(path / ADAPTER_DIR), str(path / ADAPTER_DIR))
    return _from_checkpoint(path, ft)


def generate(
    loaded: Loaded,
    prompt: str,
    *,
    chat: bool = False,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """The continuation of ``prompt`` (``chat``: as a user turn through the chat template,
    the assistant's reply). Unset sampling options come from the model's generation config."""
    tok = loaded.tokenizer
    if chat:
        if not tok.chat_template:
            raise ValueError("--chat needs a tokenizer with a chat template; this one has none")
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    ids = tok(text, return_tensors="pt", add_special_tokens=not chat)
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens or 64}
    if temperature is not None:
        kw.update(do_sample=temperature > 0)
        if temperature > 0:
            kw["temperature"] = temperature
    if top_k is not None:
        kw["top_k"] = top_k
    if tok.pad_token_id is not None:
        kw["pad_token_id"] = tok.pad_token_id
    torch.manual_seed(seed)
    model = loaded.model.eval()
    with torch.no_grad():
        out = model.generate(**ids, **kw)
    return str(tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))

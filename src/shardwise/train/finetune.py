"""The per-rank fine-tuning run: ``shardwise.train``'s loop (run directory, metrics, progress,
checkpoints, resume, signals) with a Hugging Face model, the fine-tuning data and its loss in
place of the built-in GPT on a corpus. Only what differs is overridden here."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from shardwise.comm import ops
from shardwise.hf.side_files import tokenizer_file_names
from shardwise.sft.collator import nll_sum
from shardwise.sft.generate import ADAPTER_DIR, MODEL_DIR
from shardwise.sft.model import load_tokenizer
from shardwise.sft.options import FinetuneOptions
from shardwise.sft.pipeline import TrainingData, load_training_data
from shardwise.sft.setup import FinetuneModel, build_finetune_model
from shardwise.sft.step import micro_losses
from shardwise.train.loop import Trainer
from shardwise.train.parallel import BuiltModel

log = logging.getLogger("shardwise.train")


class FinetuneTrainer(Trainer):
    """One rank of a ``shardwise finetune`` run (``run.finetune`` holds its options)."""

    fm: FinetuneModel
    data: TrainingData
    eval_data: TrainingData | None
    _tokens = 0

    @property
    def ft(self) -> FinetuneOptions:
        assert self.run_cfg.finetune is not None
        return FinetuneOptions.from_dict(self.run_cfg.finetune)

    def build_model(self) -> BuiltModel:
        ft, opts = self.ft, self.opts
        model_dir = Path(ft.model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        seq_len = opts.seq_len or 0
        kw: dict[str, Any] = {"seq_len": seq_len, "packing": ft.packing}
        kw["train_on_prompt"] = ft.train_on_prompt
        assert opts.data is not None
        self.data = load_training_data(
            opts.data, self.tokenizer, skip_bad_lines=ft.skip_bad_lines, **kw
        )
        self.eval_data = (
            None if ft.eval_data is None else load_training_data(ft.eval_data, self.tokenizer, **kw)
        )
        if self.rank == 0:
            log.info("training data: %s", self.data.report())
        self.fm = build_finetune_model(
            model_dir, self.mesh, lora=ft.lora_spec, seed=self.run_cfg.engine.seed
        )
        return BuiltModel(self.fm.parallelized)

    def build_sampler(self) -> Any:
        run = self.run_cfg
        return self.data.sampler(
            run.micro_batch,
            self.dp.rank,
            self.dp.size,
            seed=run.engine.seed,
            grad_accum=run.engine.gradient_accumulation_steps,
        )

    def micro_losses(self) -> list[float]:
        batches = [
            self.data.batch(self.sampler.next_batch())
            for _ in range(self.run_cfg.engine.gradient_accumulation_steps)
        ]
        self._tokens = sum(int((b.labels[:, 1:] != -100).sum()) for b in batches)
        return micro_losses(self.engine, batches, self.dp, self.fm.attn_implementation)

    def has_validation(self) -> bool:
        return self.eval_data is not None

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-mean loss over ``eval_batches`` micro-batches per dp rank of ``--eval-data``
        (the same ones every time). Communicates: one all_reduce of two floats over dp."""
        assert self.eval_data is not None
        sampler = self.eval_data.sampler(self.run_cfg.micro_batch, self.dp.rank, self.dp.size)
        self.engine.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        for _ in range(self.opts.eval_batches):
            batch = self.eval_data.batch(sampler.next_batch())
            logits = self.engine(**batch.model_inputs(self.fm.attn_implementation)).logits
            sums += torch.tensor([float(nll_sum(logits, batch.labels)), batch.label_count()])
        self.engine.train()
        ops.all_reduce(sums, op="sum", group=self.dp)
        return float(sums[0] / sums[1])

    def baseline(self) -> float | None:
        return None

    def headline(self) -> str:
        module = self.fm.module
        total = sum(p.numel() for p in module.parameters())
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        how = f"LoRA {self.ft.lora}" if self.ft.lora else "full"
        return (
            f"fine-tuning {self.fm.hf_config.model_type} ({how}): {trainable / 1e6:.3f}M of "
            f"{total / 1e6:.3f}M params trainable; {self.data.report()}"
        )

    def tokens_per_step(self) -> int:
        return self._tokens * self.dp.size  # labelled tokens, about (ranks' counts differ)

    def save_outputs(self, lead: bool) -> None:
        """``adapter/`` (LoRA; peft loads it) and / or ``model/`` (full fine-tuning, or LoRA
        with ``--merge``; transformers loads it), each with the tokenizer files of the model
        directory, streamed by ``engine.save_pretrained`` (no rank holds the whole model)."""
        write_outputs(self.engine, self.ft, self.dir.root, lead)

    def initialize_kwargs(self) -> dict[str, Any]:
        return self.fm.initialize_kwargs()


def write_outputs(engine: Any, ft: FinetuneOptions, root: Path, lead: bool) -> list[Path]:
    """Write what a run leaves (see ``FinetuneTrainer.save_outputs``); call on every rank
    (``lead``: the first, which writes).
    Returns the directories written. Communicates: ``save_pretrained``'s gathers."""
    model_dir = Path(ft.model_dir)
    written = []
    if ft.lora is not None:
        out = root / ADAPTER_DIR
        engine.save_pretrained(out, adapter_only=True)
        if lead:
            for f in tokenizer_file_names(model_dir):
                shutil.copyfile(f, out / f.name)
        written.append(out)
    if ft.lora is None or ft.merge:
        out = root / MODEL_DIR
        engine.save_pretrained(out, merge=ft.lora is not None, tokenizer_dir=model_dir)
        written.append(out)
    log.info("wrote %s", ", ".join(str(w) for w in written))
    return written

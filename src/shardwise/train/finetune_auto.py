"""What ``shardwise finetune --auto`` searches and times: the model directory's model as the
cost model sees it (``finetune_target``), and its one-rank step (``FinetuneProbe``), the compute
probe of the calibration.

The shape is read from the model's config and its meta-device build: layers, hidden size, heads
and key/value heads, the MLP's width and whether it is gated (three matrices of that width), tied
embeddings, its exact parameter count (LoRA's adapters included), and under LoRA the share of
parameters trained (the adapters'; the base is frozen:
no gradients, optimizer states or reductions). The search covers what the fine-tuning run can
do: data parallelism (flat or hierarchical), ZeRO 0-3, tensor parallelism at the degrees the
model type's plan splits the model by (LoRA's adapters included), recomputation of the decoder
layers, micro-batch and accumulation; not pipeline or context parallelism, which it does not
run.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from shardwise.costmodel.shapes import ModelShape
from shardwise.deferred import deferred_init
from shardwise.parallel.tensor.parallelize import check_plan
from shardwise.sft.lora import LoraSpec, apply_lora
from shardwise.sft.model import check_model_dir, decoder_layer_classes
from shardwise.sft.setup import TP_PLANS, under_peft
from shardwise.train.layout_choice import Check, Target
from shardwise.train.options import RunConfig

FINETUNE_FIXED_AXES = ("cp", "pp")
"""Mesh axes a fine-tuning run does not split."""


def _mlp_matrices(layer: torch.nn.Module, ffn: int) -> int:
    """2 for a plain MLP (up and down), 3 for a gated one (gate, up, down): the layer's
    matrices with a dimension of the MLP's width."""
    wide = sum(1 for p in layer.parameters() if p.dim() == 2 and ffn in p.shape)
    return 3 if wide >= 3 else 2


def model_shape(model: torch.nn.Module, config: Any, seq_len: int, name: str) -> ModelShape:
    """The cost model's shape of ``model`` (a Hugging Face causal LM, meta is fine; LoRA
    applied or not) built from ``config``, at ``seq_len`` tokens per sequence."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    ffn = ffn or 4 * hidden
    unwrap = getattr(model, "get_base_model", None)  # peft's wrapper holds the model
    base: Any = unwrap() if callable(unwrap) else model
    layer = next(m for m in base.modules() if type(m).__name__ in decoder_layer_classes(base))
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    tied = outputs is None or outputs.weight is inputs.weight
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad) / sum(p.numel() for p in params)
    shape = ModelShape(
        name,
        config.num_hidden_layers,
        hidden,
        heads,
        config.vocab_size,
        seq_len,
        ffn_hidden=ffn,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        mlp_matrices=_mlp_matrices(layer, ffn),
        tied_embeddings=tied,
        trainable=trainable,
    )
    # the formula's count made the model's own (biases, position tables, norms' shapes)
    return dataclasses.replace(shape, other_params=sum(p.numel() for p in params) - shape.params())


def _tp_check(model: torch.nn.Module, plan: dict[str, str] | None) -> Check:
    """A search check refusing a tp degree the model's plan cannot split ``model`` (LoRA
    applied) by: a width or head count not dividing, adapters on a layer that cannot split
    them (``plan`` None: the model type has none). Each degree is validated once."""
    verdicts: dict[int, str | None] = {}

    def check(run: RunConfig) -> None:
        tp = run.train.tp
        if tp == 1:
            return
        if tp not in verdicts:
            verdicts[tp] = None
            try:
                if plan is None:
                    raise ValueError("no tensor-parallel plan")
                check_plan(model, plan, tp)
            except (ValueError, TypeError) as exc:
                verdicts[tp] = str(exc)
        if verdicts[tp] is not None:
            raise ValueError(f"--tp {tp}: {verdicts[tp]}")

    return check


def finetune_target(
    model_dir: Path, lora: LoraSpec | None, seq_len: int
) -> tuple[Target, list[Check]]:
    """What ``finetune --auto`` searches for ``model_dir`` (``lora``: its adapters) at
    ``seq_len``, and the check its layouts must pass (the tp degrees the model splits by);
    built on the meta device, nothing allocated or read but the config."""
    from transformers import AutoModelForCausalLM

    config = check_model_dir(model_dir)
    with deferred_init():
        model = AutoModelForCausalLM.from_config(config)
    blocks = tuple(decoder_layer_classes(model))
    plan = TP_PLANS[config.model_type]() if config.model_type in TP_PLANS else None
    if lora is not None:
        with warnings.catch_warnings():  # peft's deprecation notices: not the user's concern
            warnings.simplefilter("ignore", FutureWarning)
            model = apply_lora(model, lora)
        plan = None if plan is None else under_peft(plan)
    shape = model_shape(model, config, seq_len, model_dir.name or config.model_type)
    fixed = FINETUNE_FIXED_AXES + (() if plan is not None else ("tp",))
    return Target(shape, None, blocks, fixed, sequence_parallel=False), [_tp_check(model, plan)]


class FinetuneProbe:
    """One rank's fine-tuning engine for ``run`` (its model directory, LoRA, precision and
    micro-batch) over ``group`` (one rank: nothing crosses ranks), stepped on random tokens:
    what ``finetune --auto`` times to measure compute."""

    def __init__(self, run: Any, group: Any) -> None:
        import shardwise
        from shardwise.mesh import Mesh
        from shardwise.sft.options import FinetuneOptions
        from shardwise.sft.setup import build_finetune_model
        from shardwise.train.loop import param_groups

        ft = FinetuneOptions.from_dict(run.finetune)
        self.run, self.group = run, group
        self.fm = build_finetune_model(
            Path(ft.model_dir), Mesh(world=group), lora=ft.lora_spec, seed=run.engine.seed
        )
        opt = torch.optim.AdamW(param_groups(self.fm.module, 0.0), lr=1e-4)
        cfg = run.engine.replace(checkpoint_dir=None, checkpoint_every=0)
        self.engine = shardwise.initialize(
            self.fm.parallelized, opt, cfg, **self.fm.initialize_kwargs()
        )
        self.gen = torch.Generator().manual_seed(1)
        self.vocab = self.fm.hf_config.vocab_size

    def step(self) -> float:
        """One optimizer step on fresh random sequences; this rank's seconds."""
        from shardwise.sft.collator import Batch
        from shardwise.sft.step import micro_losses

        run, dev = self.run, self.group.world.device
        seq = run.train.seq_len
        batches = []
        for _ in range(run.engine.gradient_accumulation_steps):
            ids = torch.randint(0, self.vocab, (run.micro_batch, seq), generator=self.gen)
            batches.append(Batch(ids.to(dev), ids.to(dev), torch.ones_like(ids, device=dev)))
        t0 = time.perf_counter()
        micro_losses(self.engine, batches, self.group, self.fm.attn_implementation)
        self.engine.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

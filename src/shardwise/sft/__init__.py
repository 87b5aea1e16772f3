"""Supervised fine-tuning of Hugging Face causal LMs: data, masking, packing, order, LoRA, and
the run (``shardwise finetune``; ``shardwise.finetune(...)`` from Python).

The pieces, composed in a loop of one's own::

    from shardwise import sft as ft

    data = ft.read_dataset("train.jsonl")                       # validated records
    examples = ft.prepare([ft.render(e, tok) for e in data.examples], seq_len=512).examples
    sampler = ft.ExampleSampler(len(examples), micro_batch=4, dp_rank=r, dp_size=n, seed=0)
    collate = ft.Collator(examples, ft.pad_id(tok), packing=False, seq_len=512)
    batch = collate(sampler.next_batch())                        # input_ids, labels, masks
    loss = ft.nll_sum(engine(**batch.model_inputs()).logits, batch.labels) / tokens_in_step

Modules: ``data`` (readers, validation), ``render`` (chat templates, label masking),
``packing`` (truncation, packed rows, block-diagonal masks), ``sampler`` (per-epoch order),
``collator`` (tensors, the loss), ``tokenizer`` (an offline BPE tokenizer).
"""

from shardwise.sft.collator import Batch, Collator, nll_sum
from shardwise.sft.data import DataError, Dataset, Example, parse_record, read_dataset
from shardwise.sft.packing import Prepared, block_causal_mask, pack, pack_rows, prepare
from shardwise.sft.render import IGNORE, Tokenized, check_tokenizer, pad_id, render
from shardwise.sft.sampler import ExampleSampler, single_rows

__all__ = [
    "IGNORE",
    "Batch",
    "Collator",
    "DataError",
    "Dataset",
    "Example",
    "ExampleSampler",
    "Prepared",
    "Tokenized",
    "block_causal_mask",
    "check_tokenizer",
    "nll_sum",
    "pack",
    "pack_rows",
    "pad_id",
    "parse_record",
    "prepare",
    "read_dataset",
    "render",
    "single_rows",
]

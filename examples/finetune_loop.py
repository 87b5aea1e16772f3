"""Fine-tuning pieces in a loop of one's own: dataset -> collator -> model (one process).

Run: python examples/finetune_loop.py (writes ./ft; nothing downloaded)."""

from pathlib import Path

import torch

from shardwise.sft import demo, nll_sum
from shardwise.sft.model import build_model, check_model_dir, load_base_weights, load_tokenizer
from shardwise.sft.pipeline import load_training_data

model_dir = demo.model_dir(Path("ft"), "llama")
data = load_training_data(
    demo.write_jsonl(Path("ft/chat.jsonl"), demo.chat_records()),
    load_tokenizer(model_dir),
    seq_len=64,
    packing=True,
)
model = build_model(check_model_dir(model_dir))
load_base_weights(model, model_dir)
sampler = data.sampler(micro_batch=2, dp_rank=0, dp_size=1, seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    batch = data.batch(sampler.next_batch())  # packed rows, labels, 4-D mask, position ids
    loss = nll_sum(model(**batch.model_inputs()).logits, batch.labels) / batch.label_count()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, float(loss))
state = sampler.state_dict()  # resume the data order exactly with load_state_dict(state)

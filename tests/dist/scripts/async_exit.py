"""A rank script that saves a checkpoint in the background and ends without waiting for it
(``--shutdown``: after ``shardwise.shutdown()``)."""

import argparse
import atexit

import torch
import torch.distributed as dist

import shardwise

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--shutdown", action="store_true")
args = parser.parse_args()


def report_left() -> None:  # registered before init: runs after shardwise's own exit handler
    print(f"process group still formed at exit: {dist.is_initialized()}", flush=True)


atexit.register(report_left)
shardwise.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
cfg = shardwise.Config(zero_stage=2, async_save=True, checkpoint_dir=args.checkpoint_dir)
engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
x = torch.randn(4, 8)
engine.backward(engine(x).pow(2).mean())
engine.step()
engine.save()
print(f"rank {shardwise.rank()} saved in the background; ending", flush=True)
if args.shutdown:
    shardwise.shutdown()

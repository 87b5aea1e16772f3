"""A rank script that builds six engines (ZeRO 2 and 3), trains a step on each, prints its result
and ends without ``shardwise.shutdown()``: ``exit`` through ``sys.exit(0)``, ``raise`` through an
uncaught ``ValueError`` (exit code 1). With ``--report-threads`` it prints, at the very end (an
atexit handler registered before ``shardwise.init``, so it runs after shardwise's own), how many
of torch's gloo worker threads are still running."""

import argparse
import atexit
import os
import sys

import torch

import shardwise

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["exit", "raise", "shutdown"])
parser.add_argument("--report-threads", action="store_true")
args = parser.parse_args()


def gloo_workers() -> int:
    """Threads of this process that torch named as gloo workers or gloo's network loop."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return sum(n.startswith(("pt_gloo", "gloo_tcp")) for n in names)


if args.report_threads:
    atexit.register(lambda: print(f"gloo threads left at exit: {gloo_workers()}", flush=True))
shardwise.init()
torch.manual_seed(0)
losses = []
for stage in (2, 3):
    for width in (16, 32, 64):
        model = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = shardwise.initialize(model, opt, shardwise.Config(zero_stage=stage))
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 4))
if args.report_threads:
    print(f"gloo threads while training: {gloo_workers()}", flush=True)
print(f"rank {shardwise.rank()} trained 6 engines: {losses}", flush=True)
if args.mode == "raise":
    raise ValueError(f"rank {shardwise.rank()} ends through an exception")
if args.mode == "shutdown":
    shardwise.shutdown()
sys.exit(0)

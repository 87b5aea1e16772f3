"""A rank script for launcher tests: all_reduce in a loop (until --max iterations), printing
its options so tests can see which reached the script."""

import argparse
import time

import torch

import shardwise

parser = argparse.ArgumentParser()
parser.add_argument("--max", type=int, default=10**9, help="iterations")
parser.add_argument("--d", default="", help="any value, echoed")
args = parser.parse_args()
shardwise.init()
print(f"rank {shardwise.rank()} started: max={args.max} d={args.d!r}", flush=True)
for _ in range(args.max):
    shardwise.all_reduce(torch.ones(1))
    time.sleep(0.05)
print(f"rank {shardwise.rank()} done", flush=True)
shardwise.shutdown()

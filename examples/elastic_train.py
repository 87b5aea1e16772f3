"""Fault-tolerant training: checkpoints every few steps, automatic resume after a restart.

    shardwise run --nproc-per-node 2 --max-restarts 1 examples/elastic_train.py \\
        --checkpoint-dir /tmp/elastic/ckpt --out /tmp/elastic/final.pt --kill-at-step 5

The loop saves every ``--every`` steps (``engine.maybe_save``) and starts with
``engine.resume``, which loads the newest checkpoint that verifies (none: a fresh start). With
``--kill-at-step N``, rank ``--kill-rank`` sends itself SIGKILL before step N, in the first
attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0), like a node failure: the launcher restarts
every rank and training resumes from the last checkpoint. Rank 0 writes the final full model
state to ``--out`` (``torch.save``), identical to that of a run without the failure.

With torch's c10d rendezvous, restarted ranks may find the first attempt's addresses in the
launcher's shared store (pytorch/pytorch#135712); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in
the launcher's environment gives every attempt a fresh store.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import torch

import shardwise
from shardwise.data.sampler import DistributedBatchSampler
from shardwise.models import GPT, GPTConfig

log = logging.getLogger("elastic_train")

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint-dir", required=True, help="checkpoint root (shared by ranks)")
    p.add_argument("--out", required=True, help="file for the final full model state")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps in all (default 6)")
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps (default 2)")
    p.add_argument("--zero-stage", type=int, default=2, help="ZeRO stage (default 2)")
    p.add_argument(
        "--kill-at-step",
        type=int,
        default=-1,
        help="in the first attempt, kill --kill-rank before this step (-1: never)",
    )
    p.add_argument("--kill-rank", type=int, default=1, help="the rank that dies (default 1)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    shardwise.init()
    rank, world = shardwise.rank(), shardwise.world_size()
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(name)s: %(message)s")
    torch.manual_seed(0)
    model = GPT(MODEL)
    config = shardwise.Config(
        zero_stage=args.zero_stage,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.every,
        resume="auto",
    )
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    tokens = torch.randint(0, MODEL.vocab_size, (8192,), generator=torch.Generator().manual_seed(1))
    sampler = DistributedBatchSampler(
        tokens, MODEL.seq_len, micro_batch=4, dp_rank=rank, dp_size=world, seed=0
    )
    engine.resume(sampler=sampler)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while engine.global_step < args.steps:
        if first_attempt and rank == args.kill_rank and engine.global_step + 1 == args.kill_at_step:
            log.warning("killing this rank (SIGKILL) before step %d, as asked", args.kill_at_step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = engine(*sampler.next_batch())
        engine.backward(loss)
        if engine.step():
            log.info("step %d loss %.4f", engine.global_step, loss.item())
            engine.maybe_save(sampler=sampler)
    engine.wait_for_checkpoint()
    state = engine.state_dict()
    if rank == 0:
        torch.save(state, args.out)
        log.info("wrote the final model state to %s", args.out)
    shardwise.shutdown()


if __name__ == "__main__":
    main()

"""What every rank runs to calibrate the cost model before an ``--auto`` run:
``python -m shardwise.train.calibrate_worker RUN_CONFIG OUT --budget-s S ...``.

``RUN_CONFIG`` (a config.json) names the model, sequence length and precision, and the micro-
batch of the compute probe: the model's one-rank step, run on every rank at once, each alone
(the built-in GPT's ``Trial``, or a fine-tuning run's ``train.finetune_auto.FinetuneProbe``).
Rank 0 writes the ``Calibration`` as JSON to ``OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import shardwise
from shardwise.comm import mpi_split
from shardwise.costmodel.calibrate_ranks import ComputeProbe, calibrate_ranks
from shardwise.costmodel.shapes import gpt_shape
from shardwise.train.options import RunConfig
from shardwise.train.trial import Trial


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardwise.train.calibrate_worker")
    p.add_argument("run_config", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--devices-per-node", type=int, required=True)
    p.add_argument("--memory-bytes", type=int, required=True)
    args = p.parse_args(argv)
    run = RunConfig.read(args.run_config)
    world = shardwise.init()
    alone = mpi_split.split(world.rank, 0, group=world.group)  # each rank alone
    b = run.micro_batch  # the same sequences as b micro-batches of one: their overhead
    split_run = dataclasses.replace(
        run, engine=run.engine.replace(micro_batch_size=1, gradient_accumulation_steps=b)
    )
    if run.finetune is not None:
        from shardwise.sft.options import FinetuneOptions
        from shardwise.train.finetune_auto import FinetuneProbe, finetune_target

        ft = FinetuneOptions.from_dict(run.finetune)
        assert run.train.seq_len is not None  # the launcher resolved it
        target, _ = finetune_target(Path(ft.model_dir), ft.lora_spec, run.train.seq_len)
        shape = target.shape
        step = FinetuneProbe(run, alone).step
        split = FinetuneProbe(split_run, alone).step if b > 1 else None
    else:
        shape = gpt_shape(run.train.model, run.model)
        step = Trial(run, world, group=alone).step
        split = Trial(split_run, world, group=alone).step if b > 1 else None
    probe = ComputeProbe(step, b, run.engine.precision, split)
    calib = calibrate_ranks(
        world.group, shape, probe, args.budget_s, args.devices_per_node, args.memory_bytes
    )
    if world.rank == 0:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(calib.to_dict()) + "\n")
        tmp.replace(args.out)
    shardwise.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

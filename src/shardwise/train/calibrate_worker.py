"""What every rank runs to calibrate the cost model before an ``--auto`` run:
``python -m shardwise.train.calibrate_worker RUN_CONFIG OUT --budget-s S ...``.

``RUN_CONFIG`` (a config.json) names the model, sequence length and precision, and the micro-
batch of the compute probe: the model's one-rank step, run on every rank at once, each alone.
Rank 0 writes the ``Calibration`` as JSON to ``OUT``.
"""

from __future__ import annotations

import argparse
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
    trial = Trial(run, world, group=alone)
    b = run.micro_batch  # the same sequences as b micro-batches of one: their overhead
    split_run = RunConfig(train=run.train, world_size=run.world_size, launch=run.launch,
                          engine=run.engine.replace(micro_batch_size=1,
                                                    gradient_accumulation_steps=b))  # fmt: skip
    split = Trial(split_run, world, group=alone).step if b > 1 else None
    probe = ComputeProbe(trial.step, b, run.engine.precision, split)
    shape = gpt_shape(run.train.model, run.model)
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

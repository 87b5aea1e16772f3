"""What ``shardwise train`` checks in the launcher before a rank starts, so that a mistake the
user can fix is one line and exit code 2, not a traceback from every rank: the parallel layout
fits the ranks and the model, the corpus holds enough text, one rank's memory fits the machine,
the run directory can be written."""

from __future__ import annotations

import os

import psutil
import torch

from shardwise.costmodel.memory import zero_shard_size
from shardwise.data.corpus import check_corpus_fits, load_corpus
from shardwise.estimate import estimate_activations, estimate_model_states, format_bytes
from shardwise.parallel import layout as par
from shardwise.train.options import RunConfig
from shardwise.train.rundir import RunDir


def check_layout(run: RunConfig) -> None:
    """Refuse a layout the ranks, the GPT or the micro-batch cannot split evenly, with the
    check ``plan``, ``estimate`` and ``pipeline simulate`` share
    (``shardwise.parallel.layout``): degrees dividing the ranks, the heads and the width, a
    transformer block for every pipeline stage, ``--micro-batch`` splitting into
    ``--microbatches``, pipeline options only with ``--pp`` > 1."""
    opts, eng = run.train, run.engine
    layout = par.Layout(
        world_size=run.world_size,
        tp=opts.tp,
        pp=opts.pp,
        cp=opts.cp,
        cp_method=opts.cp_method,
        dp_replicate=opts.dp_replicate,
        sequence_parallel=opts.sequence_parallel,
        schedule=eng.pipeline_schedule,
        microbatches=eng.pipeline_microbatches,
        virtual_stages=eng.pipeline_virtual_stages or 1,
    )
    dims = par.gpt_dims(opts.model, run.model)
    par.check_layout(layout, model=dims, micro_batch=run.micro_batch, flags=par.TRAIN_FLAGS)


def check_data(run: RunConfig) -> None:
    """Load the corpus as the ranks will (only for ``--data`` or ``--max-bytes``: the default,
    whole standard library is known to be large enough) and check both splits hold a sequence."""
    opts = run.train
    if opts.data is None and opts.max_bytes is None:
        return
    corpus = load_corpus(opts.data, max_bytes=opts.max_bytes)
    check_corpus_fits(corpus, run.model.seq_len)


def memory_per_rank(nproc_per_node: int) -> tuple[int, str]:
    """Bytes one rank may use (a GPU's memory, or the host's shared by the ranks), in words."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "each GPU's memory"
    total = psutil.virtual_memory().total
    return (
        total // nproc_per_node,
        f"this machine's {format_bytes(total)} shared by {nproc_per_node} ranks",
    )


def check_memory(run: RunConfig, nproc_per_node: int) -> None:
    """Refuse a run whose estimated model states plus activations of one rank exceed the
    memory a rank has (an absurd ``--micro-batch`` fails here, not after allocating)."""
    cfg, eng = run.model, run.engine
    act = estimate_activations(
        cfg,
        run.micro_batch,
        cfg.seq_len // run.train.cp,  # a cp rank's tokens of each sequence
        eng.precision,
        checkpointing=bool(eng.activation_checkpointing),
    )
    states = estimate_model_states(
        run.params_per_rank(),
        zero_shard_size(run.dp_size * run.train.cp, run.train.dp_replicate),  # dp x cp
        eng.precision,
        offload=eng.offload_optimizer,
        reduce_dtype=eng.reduce_dtype,
    )[eng.zero_stage].total_bytes
    have, where = memory_per_rank(nproc_per_node)
    if act + states > have:
        raise ValueError(
            f"one rank needs about {format_bytes(act + states)} ({format_bytes(act)} of "
            f"activations for --micro-batch {run.micro_batch} x {cfg.seq_len} tokens), more than "
            f"{where}: lower --micro-batch or --seq-len, or use --activation-checkpointing"
        )


def open_run_dir(run_dir: RunDir) -> None:
    """Create the run directory; ``ValueError`` when it cannot be created or written."""
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the run directory {run_dir.root}: {exc.strerror}") from exc
    if not os.access(run_dir.root, os.W_OK):
        raise ValueError(f"the run directory {run_dir.root} is not writable: choose another")


def write_config(run: RunConfig, run_dir: RunDir) -> None:
    """Write ``config.json``; ``ValueError`` naming the cause (read-only, disk full)."""
    try:
        run.write(run_dir.config)
    except OSError as exc:
        raise ValueError(
            f"cannot write {run_dir.config}: {exc.strerror} (is the disk full or read-only?)"
        ) from exc

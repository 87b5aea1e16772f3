"""What ``shardwise train`` checks in the launcher before a rank starts, so that a mistake the
user can fix is one line and exit code 2, not a traceback from every rank: the parallel layout
fits the ranks and the model, the corpus holds enough text, one rank's memory fits the machine,
the run directory can be written."""

from __future__ import annotations

import os

import psutil
import torch

from shardwise.data.corpus import check_corpus_fits, load_corpus
from shardwise.estimate import estimate_activations, estimate_model_states, format_bytes
from shardwise.pipeline.schedule import build_schedule
from shardwise.train.options import RunConfig
from shardwise.train.parallel import PIPELINE_LAYERS_AROUND_BLOCKS
from shardwise.train.rundir import RunDir


def check_layout(run: RunConfig) -> None:
    """Refuse a tensor-parallel layout the ranks or the GPT cannot split evenly: ``--tp`` must
    divide the ranks, the attention heads and the width; ``--sequence-parallel`` needs
    ``--tp`` > 1 and a sequence length divisible by it; ``--dp-replicate`` must divide the dp
    ranks."""
    opts, cfg = run.train, run.model
    tp, pp = opts.tp, opts.pp
    if run.world_size % (tp * pp):
        what = f"--tp {tp}" if pp == 1 else f"--pp {pp}" if tp == 1 else f"--tp {tp} x --pp {pp}"
        raise ValueError(
            f"{what} does not divide the {run.world_size} ranks (--nproc-per-node x "
            "--nnodes): choose degrees whose product divides them"
        )
    if cfg.n_head % tp or cfg.d_model % tp:
        raise ValueError(
            f"--tp {tp} does not divide the {opts.model} model's n_head={cfg.n_head} heads and "
            f"d_model={cfg.d_model}: choose a --tp dividing both"
        )
    if opts.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel splits the sequence over tp ranks: add --tp > 1")
    r = opts.dp_replicate
    if run.dp_size % r:
        raise ValueError(
            f"--dp-replicate {r} does not divide the {run.dp_size} data-parallel ranks: choose "
            "a divisor (e.g. the number of nodes)"
        )
    if opts.sequence_parallel and cfg.seq_len % tp:
        raise ValueError(
            f"--sequence-parallel needs the sequence length {cfg.seq_len} divisible by "
            f"--tp {tp}: change --seq-len or --tp"
        )


def check_pipeline(run: RunConfig) -> None:
    """Refuse pipeline options the GPT or the pipeline engine cannot run: the schedule must be
    buildable for pp and the micro-batches, every stage needs a layer, each ``--micro-batch``
    splits into ``--microbatches`` equal parts, and ``--schedule`` / ``--microbatches`` only
    with ``--pp`` > 1."""
    opts, eng = run.train, run.engine
    pp, m = opts.pp, eng.pipeline_microbatches
    if pp == 1:
        if m != 1 or eng.pipeline_schedule != "1f1b" or eng.pipeline_virtual_stages != 1:
            raise ValueError("--schedule and --microbatches run a pipeline: add --pp > 1")
        return
    layers = run.model.n_layer + PIPELINE_LAYERS_AROUND_BLOCKS
    stages = pp * eng.pipeline_virtual_stages
    if layers < stages:
        raise ValueError(
            f"the {opts.model} model's {layers} pipeline layers cannot fill {stages} stages "
            f"(--pp {pp} x {eng.pipeline_virtual_stages} per rank): lower --pp"
        )
    build_schedule(eng.pipeline_schedule, pp, m, eng.pipeline_virtual_stages)
    if run.micro_batch % m:
        raise ValueError(
            f"--micro-batch {run.micro_batch} does not split into --microbatches {m} equal "
            "pipeline micro-batches: choose a --micro-batch divisible by it"
        )


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
        cfg.seq_len,
        eng.precision,
        checkpointing=bool(eng.activation_checkpointing),
    )
    states = estimate_model_states(
        run.params_per_rank(),
        run.dp_size,
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

"""Saving and loading a whole training engine, at any world size, stage or precision.

    path = save_engine(engine, "ckpt", sampler=sampler)    # every rank; rank 0 commits
    state = load_engine(engine, "ckpt", sampler=sampler)   # every rank; any world size

``Engine.save`` / ``load`` / ``resume`` / ``maybe_save`` / ``wait_for_checkpoint`` /
``load_full_state`` are :class:`shardwise.engine.checkpoint_methods.EngineCheckpoints`
methods. A checkpoint holds the logical
tensors of ``zero.checkpoint_entries`` (fp32 masters ``model/``, element-wise optimizer states
``optim/``, buffers ``buffer/``), each rank writing only its own boxes, plus the trainer state
(JSON, in the manifest: steps, config, scheduler, optimizer settings, sampler position...) and
one rank state per rank (RNG states as tensors and JSON, never a pickle).

Loading reads, on each rank, exactly the ranges its master and optimizer pieces cover now, so the
world size, the (dp, tp) layout, ZeRO stage and precision may all differ from the run that saved:
tensor-parallel pieces are saved and read as boxes of their whole, unpadded tensors. A
pipeline's stages each write their own parameters under the whole model's names (a tied weight
once, by its first holder), so it loads at any (pp, dp) layout or into a plain ``Engine`` over
the ``LayerStack`` of the same layers. The ranks that save together are the engine's whole mesh
(or its dp group). RNG states are restored only at the same world size; otherwise re-seeded.
Resuming skips damaged newer checkpoints and sets them aside (``damaged-step-N``), and rebuilds a
lost journal from the manifests. Trainer and rank state: ``shardwise.engine.run_state``; full
weights (export, ``load_pretrained``): ``shardwise.engine.weights``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shardwise.checkpoint.async_writer import AsyncCheckpointWriter
from shardwise.checkpoint.integrity import (
    check_file,
    check_manifest_sha256,
    committed_manifest_sha256,
    read_manifest,
)
from shardwise.checkpoint.journal import resolve
from shardwise.checkpoint.layout import CheckpointError, step_dir_name
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.retention import prepare_resume
from shardwise.checkpoint.writer import save_checkpoint
from shardwise.comm import objects
from shardwise.comm.groups import Group
from shardwise.engine.run_state import (
    ENGINE_FORMAT,
    READABLE_ENGINE_VERSIONS,
    CheckpointState,
    Stateful,
    rank_state,
    restore_rng,
    restore_trainer,
    trainer_state,
)
from shardwise.engine.save_group import gather_scalars, whole_model_entries
from shardwise.zero.checkpoint_entries import (
    ModelNames,
    check_model_matches,
    flat_entries,
    load_flats,
    load_replicated,
    replicated_entries,
    saved_flats,
)
from shardwise.zero.step import zero_grads

__all__ = ["CheckpointState", "load_engine", "resume_engine", "save_engine"]

log = logging.getLogger("shardwise.checkpoint")


# ---- saving ----


def _check_saveable(engine: CheckpointState) -> None:
    accum = engine.config.gradient_accumulation_steps
    if engine.steps.micro_step % accum:
        raise ValueError(
            f"save at an optimizer-step boundary (after engine.step()): micro-step "
            f"{engine.steps.micro_step} is inside an accumulation window of {accum}, and "
            f"accumulated gradients are not saved"
        )


def save_engine(
    engine: CheckpointState,
    root: Path | str,
    *,
    sampler: Stateful | None = None,
    extra: dict[str, Any] | None = None,
    async_writer: AsyncCheckpointWriter | None = None,
    verify_writes: bool = True,
) -> Path:
    """Save an engine's complete training state (``Engine.checkpoint_state()``) as its global
    step under ``root``.

    Call on every rank, between optimizer steps. Each rank writes only its pieces (see
    ``engine_shards``); rank 0 commits the manifest.

    Args:
        root: checkpoint root every rank sees; the checkpoint is ``root/step-{step:08d}``.
        sampler: a data sampler whose ``state_dict()`` is saved (its position).
        extra: JSON-able values of the caller's, returned by ``load_engine`` under "extra".
        async_writer: save in the background through it (its root must be ``root``): this
            returns once the pieces are copied to host memory; ``async_writer.wait()`` blocks
            until the commit.
        verify_writes: read each written file back and check its sha256 before the commit
            (synchronous saves; an async writer has its own setting).

    Returns:
        The checkpoint's path (with ``async_writer``: where it will be once committed).

    Communicates: one all_gather_object of scalar optimizer states over the saving group, then
    the collectives of ``save_checkpoint`` (from the writer's thread when async).
    """
    group = engine.save_group
    _check_saveable(engine)
    names = ModelNames.of(engine.module)
    layouts = engine.placements.layouts(engine.module, engine.zero_group)
    flats, frozen = list(engine.flats), engine.config.checkpoint_frozen
    entries, local = flat_entries(saved_flats(flats, frozen), engine.optimizer, names, layouts)
    entries += replicated_entries(
        engine.module,
        flats,
        names,
        engine.shard_group.rank,
        engine.shard_group.size,
        layouts,
        {n: b for n, b in names.buffers.items() if engine.writes_buffer(n)},
        frozen,
    )
    state = trainer_state(engine, names, gather_scalars(engine, local), sampler, extra)
    step = engine.steps.global_step
    if async_writer is not None:
        if async_writer.root != Path(root):
            raise ValueError(
                f"async_writer saves into {async_writer.root}, not {root}; use a "
                f"writer made for this root"
            )
        async_writer.save(step, entries, state, rank_state())
        return Path(root) / step_dir_name(step)
    return save_checkpoint(
        root,
        step,
        entries,
        state,
        rank_state(),
        keep_last=engine.config.keep_last,
        group=group,
        verify_writes=verify_writes,
    )


# ---- loading ----


def _verify_together(step_dir: Path, group: Group) -> None:
    """Check the commit, the manifest and every file's sha256, each rank reading a share of the
    files; every rank raises the first problem found. Communicates: one all_gather_object."""
    problem: tuple[str, str | None] | None = None
    try:
        recorded = committed_manifest_sha256(step_dir)
        manifest, sha = read_manifest(step_dir)
        check_manifest_sha256(step_dir, sha, recorded)
        files = sorted(manifest.files)
        for name in files[group.rank :: group.size]:
            record = manifest.files[name]
            check_file(step_dir, name, record.size, record.sha256)
    except CheckpointError as exc:
        problem = (exc.problem, None if exc.path is None else str(exc.path))
    found = [p for p in objects.all_gather_object(problem, group=group) if p is not None]
    if found:
        raise CheckpointError(*found[0])


def _check_format(state: dict[str, Any], engine: CheckpointState, step_dir: Path) -> None:
    fmt = state.get("format", {})
    if fmt.get("name") != ENGINE_FORMAT["name"] or fmt.get("version") not in (
        READABLE_ENGINE_VERSIONS
    ):
        raise CheckpointError(
            f"not a {ENGINE_FORMAT['name']} checkpoint of version "
            f"{' or '.join(str(v) for v in READABLE_ENGINE_VERSIONS)} (trainer_state format "
            f"{fmt}); read its tensors with shardwise.checkpoint.CheckpointReader",
            step_dir,
        )
    saved, now = state["optimizer"]["class"], type(engine.optimizer).__name__
    if saved != now:
        raise ValueError(
            f"the checkpoint's optimizer is {saved}, this engine's {now}: build the "
            f"engine with {saved}, or load only the weights with "
            f"engine.load_full_state({step_dir})"
        )


def load_engine(
    engine: CheckpointState,
    path_or_root: Path | str,
    *,
    sampler: Stateful | None = None,
    which: str | int = "latest",
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint of ``save_engine`` into ``engine``; call on every rank.

    The world size, ZeRO stage and precision may differ from the saving run: each rank reads
    the flat ranges it owns now. Restores masters and parameters, optimizer states,
    hyperparameters, loss scaler, scheduler, global and micro step, ``sampler``'s position and
    (same world size only) RNG states. Gradients are dropped.

    Args:
        path_or_root: a ``step-N`` directory, or a checkpoint root.
        which: with a root, ``"latest"`` (newest committed) or a step number.
        verify: check every file's sha256 first (the ranks share the reading).

    Returns:
        The trainer state (see the module docstring); the caller's values are under "extra".

    Raises:
        CheckpointError naming the damaged or missing file; ValueError when the checkpoint
        does not fit the model or optimizer.

    Communicates: the verification's all_gather_object; with pp > 1, one all_gather_object of
    the stages' names; stages 1-2: one all_gather per flat buffer to refresh the replicated
    parameters.
    """
    step_dir = resolve(path_or_root, which)
    if verify:
        _verify_together(step_dir, engine.save_group)
    names = ModelNames.of(engine.module)
    layouts = engine.placements.layouts(engine.module, engine.zero_group)
    flats, frozen = list(engine.flats), engine.config.checkpoint_frozen
    with CheckpointReader(step_dir, verify=False) as reader:
        state = reader.trainer_state
        saved_world = reader.world_size  # every rank that wrote a file: dp x tp x pp of then
        _check_format(state, engine, step_dir)
        expected = whole_model_entries(engine, names, layouts)
        # without frozen parameters, a checkpoint that holds them loads too (they are skipped)
        kept = whole_model_entries(engine, names, layouts, frozen) if not frozen else expected
        check_model_matches(reader, kept, ignored=set(expected) - set(kept))
        scalars = state["optimizer"]["scalar_states"]
        load_flats(saved_flats(flats, frozen), engine.optimizer, reader, names, scalars, layouts)
        load_replicated(engine.module, flats, reader, names, layouts, frozen)
        handles = [f.publish_master() for f in flats]
        for h in handles:
            if h is not None:
                h.wait()
        for f in flats:
            f.release()
        zero_grads(flats)
        restore_trainer(engine, state, sampler)
        restore_rng(engine, reader)
    log.info(
        "rank %d: loaded step %d from %s (saved by %d ranks, dp %d, at stage %d, %s; now %d "
        "ranks, dp %d, at stage %d, %s)",
        engine.me,
        engine.steps.global_step,
        step_dir,
        saved_world,
        state["dp_size"],
        state["zero_stage"],
        state["precision"],
        engine.save_group.size,
        engine.dp_size,
        engine.stage.stage,
        engine.config.precision,
    )
    return state


def resume_engine(
    engine: CheckpointState, root: Path | str, *, sampler: Stateful | None = None
) -> dict[str, Any] | None:
    """Load the newest checkpoint under ``root`` that verifies; None when there is none.

    Rank 0 searches and verifies (``checkpoint.retention.prepare_resume``: a lost journal is
    rebuilt from the manifests; damaged or uncommitted newer checkpoints are skipped with a
    warning naming each one and why, and set aside as ``damaged-step-N`` so that training saves
    those steps again); the others follow its choice.
    Communicates: one broadcast_object, then ``load_engine``'s collectives.
    """
    outcome: tuple[str | None, list[tuple[str, str]]] | str | None = None
    group = engine.save_group
    if group.rank == 0:
        try:
            found, passed_over = prepare_resume(root)
            outcome = (
                None if found is None else str(found),
                [(str(p), why) for p, why in passed_over],
            )
        except Exception as exc:  # raised on every rank below
            outcome = f"{type(exc).__name__}: {exc}"
    outcome = objects.broadcast_object(outcome, src=group.ranks[0], group=group)
    if isinstance(outcome, str) or outcome is None:
        raise CheckpointError(f"searching for a checkpoint to resume from failed: {outcome}", root)
    found_name, skipped = outcome
    if found_name is None:
        log.log(
            logging.WARNING if skipped else logging.INFO,
            "rank %d: no %scheckpoint in %s: starting fresh",
            engine.me,
            "valid " if skipped else "",
            root,
        )
        return None
    if skipped and group.rank == 0:  # find_latest_valid logged each one's reason
        log.warning(
            "rank 0: resume fell back past %d damaged checkpoint(s) %s to %s, the "
            "newest one that verifies",
            len(skipped),
            [Path(p).name for p, _ in skipped],
            found_name,
        )
    return load_engine(engine, found_name, sampler=sampler, verify=False)

"""An engine's saving methods: checkpoints (``save``, ``load``, ``resume``...), each handing
over to its ``EngineCheckpoints``, which reads what it saves from the engine's one
``checkpoint_state()`` value; and the Hugging Face export (``save_pretrained``,
``shardwise.engine.export``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, cast

import torch

from shardwise.checkpoint.async_writer import AsyncCheckpointWriter
from shardwise.engine.checkpoint import load_engine, resume_engine, save_engine
from shardwise.engine.export import ExportableEngine, ExportReport, save_pretrained
from shardwise.engine.run_state import CheckpointState, Stateful
from shardwise.engine.weights import FullStateTarget, load_pretrained


class CheckpointedEngine(FullStateTarget, Protocol):
    """An engine with checkpoints: it builds its ``CheckpointState`` (and takes full weights)."""

    def checkpoint_state(self) -> CheckpointState: ...


class EngineCheckpoints:
    """An engine's checkpoint methods (``Engine.save``, ``load``, ``resume``...): where its
    checkpoints go, its background writer, and the last step saved or loaded.

    The training loop drives them; ``step()`` never saves by itself::

        engine.resume(sampler=sampler)           # resume="auto": newest valid checkpoint
        while engine.global_step < steps:
            ...forward / backward...
            if engine.step():
                engine.maybe_save(sampler=sampler)  # every config.checkpoint_every steps
        engine.wait_for_checkpoint()              # async saves: before the process exits
    """

    def __init__(self, engine: CheckpointedEngine) -> None:
        self.engine = engine
        self.writer: AsyncCheckpointWriter | None = None
        self.last_saved_step: int | None = None

    def root(self, path: str | Path | None) -> Path:
        """``path``, or ``config.checkpoint_dir`` when None (ValueError when neither is set)."""
        root = path if path is not None else self.engine.checkpoint_state().config.checkpoint_dir
        if root is None:
            raise ValueError(
                "no checkpoint directory: pass path= or set Config(checkpoint_dir=...)"
            )
        return Path(root)

    def save(
        self,
        path: str | Path | None = None,
        *,
        sampler: Stateful | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """See ``Engine.save``."""
        root = self.root(path)
        state = self.engine.checkpoint_state()
        cfg = state.config
        writer = None
        if cfg.async_save:
            if self.writer is None or self.writer.root != root:
                self.wait()
                self.writer = AsyncCheckpointWriter(
                    root, keep_last=cfg.keep_last, group=state.save_group
                )
            writer = self.writer
        out = save_engine(state, root, sampler=sampler, extra=extra, async_writer=writer)
        self.last_saved_step = state.steps.global_step
        return out

    def maybe_save(self, *, sampler: Stateful | None = None) -> Path | None:
        """See ``Engine.maybe_save``."""
        state = self.engine.checkpoint_state()
        every, step = state.config.checkpoint_every, state.steps.global_step
        if not every or step == 0 or step % every or step == self.last_saved_step:
            return None
        return self.save(sampler=sampler)

    def load(
        self, path: str | Path = "latest", *, sampler: Stateful | None = None
    ) -> dict[str, Any]:
        """See ``Engine.load``."""
        self.wait()
        engine = self.engine.checkpoint_state()
        state = load_engine(engine, self.root(None if path == "latest" else path), sampler=sampler)
        self.last_saved_step = engine.steps.global_step
        return state

    def resume(self, *, sampler: Stateful | None = None) -> dict[str, Any] | None:
        """See ``Engine.resume``."""
        engine = self.engine.checkpoint_state()
        if engine.config.resume != "auto":
            return None
        state = resume_engine(engine, self.root(None), sampler=sampler)
        if state is not None:
            self.last_saved_step = engine.steps.global_step
        return state

    def wait(self) -> Path | None:
        """See ``Engine.wait_for_checkpoint``."""
        return None if self.writer is None else self.writer.wait()

    def load_full_state(self, source: str | Path | dict[str, torch.Tensor]) -> None:
        """See ``Engine.load_full_state``."""
        load_pretrained(self.engine, source)


class CheckpointMethods:
    """Mixed into ``Engine``: its public checkpoint API."""

    def checkpoint_state(self) -> CheckpointState:
        raise NotImplementedError

    _ckpt: EngineCheckpoints | None = None

    @property
    def checkpoints(self) -> EngineCheckpoints:
        """This engine's checkpoint state: its background writer and last saved step."""
        if self._ckpt is None:
            self._ckpt = EngineCheckpoints(cast(CheckpointedEngine, self))  # an Engine is one
        return self._ckpt

    def save(
        self,
        path: str | Path | None = None,
        *,
        sampler: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Save a sharded checkpoint of step ``global_step``; call on every rank.

        Args:
            path: checkpoint root (default ``config.checkpoint_dir``).
            sampler: a data sampler whose position is saved (``state_dict()``).
            extra: JSON-able values returned by ``load`` under "extra".

        With ``config.async_save`` the state is copied to host memory and written by a
        background thread while training goes on (the first async save forms the writer's
        process group: every rank must make it together); ``wait_for_checkpoint()`` blocks
        until it is committed. Returns the checkpoint's path. Communicates: see
        ``shardwise.engine.checkpoint.save_engine``.
        """
        return self.checkpoints.save(path, sampler=sampler, extra=extra)

    def maybe_save(self, *, sampler: Any = None) -> Path | None:
        """Save when ``global_step`` is a positive multiple of ``config.checkpoint_every`` and
        was not saved yet (call it after every ``step()``, on every rank); else do nothing.
        Returns the checkpoint's path, or None."""
        return self.checkpoints.maybe_save(sampler=sampler)

    def load(self, path: str | Path = "latest", *, sampler: Any = None) -> dict[str, Any]:
        """Load a checkpoint into this engine (any world size, stage or precision may have
        written it); call on every rank. ``path``: ``"latest"`` (newest committed in
        ``config.checkpoint_dir``), a checkpoint root, or a ``step-N`` directory. Verifies every
        file first and raises ``CheckpointError`` naming a damaged one. Returns the trainer
        state. Communicates: see ``shardwise.engine.checkpoint.load_engine``."""
        return self.checkpoints.load(path, sampler=sampler)

    def resume(self, *, sampler: Any = None) -> dict[str, Any] | None:
        """``config.resume == "auto"``: load the newest checkpoint in ``config.checkpoint_dir``
        that verifies, skipping damaged ones with a warning that names each and why and setting
        them aside (``damaged-step-N``); no checkpoint: log it and start fresh. ``"never"``: do
        nothing. Call on every rank before training. Returns the trainer state, or None when
        nothing was loaded. Communicates: see ``shardwise.engine.checkpoint.resume_engine``."""
        return self.checkpoints.resume(sampler=sampler)

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the pending background save is committed (raising its error); returns
        the last committed path of the async writer (None if it never saved)."""
        return self.checkpoints.wait()

    def load_full_state(self, path_or_state_dict: str | Path | dict[str, torch.Tensor]) -> None:
        """Start from full model weights: a state dict, a ``.safetensors`` file (e.g. from
        ``shardwise checkpoint export``), a ``torch.save`` file or a checkpoint directory; call
        on every rank right after ``initialize``. Optimizer states are untouched (empty).
        Communicates nothing."""
        self.checkpoints.load_full_state(path_or_state_dict)

    def save_pretrained(
        self,
        out_dir: str | Path,
        max_shard_size: int | str = "5GB",
        **options: Any,
    ) -> ExportReport:
        """Write the model as a Hugging Face directory (sharded safetensors, index, the
        model's ``config.json`` and ``generation_config.json`` where it has them) that
        ``transformers`` ``from_pretrained`` loads, from any layout (dp, tp, pp, ZeRO 0-3,
        HSDP): tp pieces joined, vocabulary padding cut, parameters at master precision. Call
        on every rank; the first rank writes. Files are written atomically (temp names, fsync,
        rename), and no rank holds more than one output tensor at a time.

        Args:
            out_dir: the directory (created; an earlier export there is replaced).
            max_shard_size: bytes per weights file (``"5GB"``, ``"500MB"`` or an int).
            options: ``config=`` / ``generation_config=`` (default: the model's own),
                ``tokenizer_dir=`` (tokenizer files copied alongside), ``dtype=`` (floating
                tensors cast to it), ``names=`` (pipeline names -> the plain model's, default:
                those ``shardwise.parallelize`` recorded), and for a peft LoRA model
                ``adapter_only=True`` (``adapter_model.safetensors`` +
                ``adapter_config.json`` for ``PeftModel.from_pretrained``) or ``merge=True``
                (the base model with the adapter folded in), ``adapter_name=``.

        Returns:
            What was written (names in order, this rank's peak bytes of output tensors held).

        Communicates: per output tensor, its gathers on the owning stage (one all_gather over
        the ZeRO shard group, one per tp split axis) and, with a pipeline, one send to the
        writer; one all_gather_object over pp of the tensor lists; one broadcast_object of
        the outcome.
        """
        engine = cast(ExportableEngine, self)  # an Engine is one
        return save_pretrained(engine, out_dir, max_shard_size, **options)

"""A model split into pipeline stages: each pp rank builds and holds only its own layers.

``layers`` is the model as a flat list run in order; an entry is a module, a ``LayerSpec``
(built only on the stage that owns it, so a model too big for one rank never exists whole) or a
``Tied`` entry (one module used at several places, e.g. the input embedding and the output
head, whose copies on different stages stay bitwise equal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.comm import ops
from shardwise.mesh import Axis, Mesh
from shardwise.parallel.pipeline.partition import partition_layers
from shardwise.parallel.placement import StageOwned


class LayerSpec:
    """A layer described, not built: ``LayerSpec(nn.Linear, 16, 16)`` builds
    ``nn.Linear(16, 16)`` on the stage that owns it."""

    def __init__(self, cls: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(cls):
            raise TypeError(f"LayerSpec needs a module class or factory, got {cls!r}")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def build(self, seed: int | None = None) -> nn.Module:
        """Build the module; with ``seed``, its initialisation draws from ``torch.manual_seed(
        seed)`` without touching the caller's random state."""
        if seed is None:
            return self._make()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._make()

    def _make(self) -> nn.Module:
        module = self.cls(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"LayerSpec({self.cls!r}) built {type(module).__name__}, not a Module")
        return module

    def count_parameters(self) -> int:
        """Parameter count, built on the meta device (no memory)."""
        with torch.device("meta"):
            return sum(p.numel() for p in self._make().parameters())

    def __repr__(self) -> str:
        return f"LayerSpec({getattr(self.cls, '__name__', self.cls)})"


class LayerFn(nn.Module):
    """A layer made of named modules and a function: ``LayerFn(fn, pos=emb)`` runs
    ``fn(self, x)`` where ``self.pos`` is ``emb`` (its parameters belong to this layer)."""

    def __init__(
        self, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], **modules: nn.Module
    ) -> None:
        super().__init__()
        self.fn = fn
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


class Tied:
    """One module used at several places of ``layers`` under one ``key``; each stage holding an
    occurrence keeps a copy, gradients are summed over the holders before the step.

    ``forward_fn(module, x)`` replaces ``module(x)`` at this occurrence, e.g. the output head
    ``Tied("embed", emb, forward_fn=lambda emb, h: h @ emb.weight.t())``.
    """

    def __init__(
        self,
        key: str,
        module_or_spec: nn.Module | LayerSpec,
        forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError(f"Tied key must be a non-empty str, got {key!r}")
        if not isinstance(module_or_spec, (nn.Module, LayerSpec)):
            raise TypeError(
                f"Tied({key!r}) needs a module or LayerSpec, got {type(module_or_spec).__name__}"
            )
        self.key, self.source, self.forward_fn = key, module_or_spec, forward_fn


Entry = nn.Module | LayerSpec | Tied


def _param_count(entry: Entry) -> int:
    source = entry.source if isinstance(entry, Tied) else entry
    if isinstance(source, LayerSpec):
        return source.count_parameters()
    return sum(p.numel() for p in source.parameters())


def layer_parameter_counts(layers: Sequence[Entry]) -> list[int]:
    """The parameter count of every pipeline layer, as ``partition="parameters"`` weighs them
    (a ``Tied`` entry counts its source's parameters wherever it appears)."""
    return [_param_count(e) for e in check_entries(layers)]


def _build(source: nn.Module | LayerSpec, seed: int | None) -> nn.Module:
    return source.build(seed) if isinstance(source, LayerSpec) else source


def check_entries(layers: Sequence[Entry]) -> list[Entry]:
    """``layers`` as a list; TypeError naming the first entry of another kind."""
    entries = list(layers)
    for i, e in enumerate(entries):
        if not isinstance(e, (nn.Module, LayerSpec, Tied)):
            raise TypeError(
                f"layers[{i}] is {type(e).__name__}; allowed: nn.Module, LayerSpec, Tied"
            )
    return entries


def build_entry(
    entries: Sequence[Entry],
    i: int,
    layers: nn.ModuleDict,
    tied: nn.ModuleDict,
    first_of: dict[str, int],
    seed: int | None,
) -> None:
    """Build ``entries[i]`` into ``layers[str(i)]``, or a tied module into ``tied[key]`` once
    (seeded by its first index ``first_of[key]``): the names a checkpoint stores, the same at
    every pipeline layout."""
    e = entries[i]
    if isinstance(e, Tied):
        if e.key not in tied:
            tied[e.key] = _build(e.source, None if seed is None else seed + first_of[e.key])
    else:
        layers[str(i)] = _build(e, None if seed is None else seed + i)


def first_indices(entries: Sequence[Entry]) -> dict[str, int]:
    """Each tied key's first index in ``entries``."""
    first: dict[str, int] = {}
    for i, e in enumerate(entries):
        if isinstance(e, Tied):
            first.setdefault(e.key, i)
    return first


def run_entries(
    entries: Mapping[int, Entry] | Sequence[Entry],
    indices: range,
    layers: nn.ModuleDict,
    tied: nn.ModuleDict,
    x: torch.Tensor,
) -> torch.Tensor:
    """``x`` through ``entries[i]`` for ``i`` in ``indices``, in order."""
    for i in indices:
        e = entries[i]
        if isinstance(e, Tied):
            module = tied[e.key]
            x = e.forward_fn(module, x) if e.forward_fn is not None else module(x)
        else:
            x = layers[str(i)](x)
    return x


class PipelineModule(nn.Module):
    """The layers of this pp rank's stages (``virtual_stages`` chunks per rank, stage ``s`` on
    pp rank ``s % pp``).

    Args:
        layers: the model in order (modules, ``LayerSpec``s, ``Tied`` entries).
        loss_fn: ``loss_fn(output, target)`` -> the mean loss of one micro-batch.
        mesh: the process mesh; stages go along its ``pp`` axis.
        partition: ``"parameters"`` (balance parameter counts), ``"uniform"`` (balance layer
            counts) or the list of cut indices (``pp * virtual_stages - 1`` increasing indices
            into ``layers`` where a new stage starts).
        virtual_stages: chunks per rank (for the interleaved schedule).
        seed: build layer ``i`` from ``LayerSpec`` under seed ``seed + i`` (a tied module under
            its first index) so the split model starts as the whole one would.
        plain_names: this module's parameter and buffer names -> the unsplit model's
            (``shardwise.parallelize`` records them), for exports under the model's own names.
        materialize: for layers on the meta device (a model built in
            ``shardwise.deferred_init``): called with this module once this rank's layers are
            in it, to make them real (``shardwise.parallelize`` passes one that initializes
            them as the whole model's eager build would, so no rank ever holds another
            stage's weights). Without it, meta layers stay on the meta device (for
            ``shardwise.initialize(..., weights=...)`` to stream into).

    Only this rank's entries stay referenced: once the caller drops the whole model, the
    layers of other stages (and tied modules this rank does not use) are freed. Built from a
    model on the meta device, they are never allocated at all.

    Communicates at construction: broadcasts each tied module from its first holder (over the
    pp group when every pp rank holds it; otherwise over a group per tied key and (dp, tp)
    coordinate that all ranks of the world form, collectively).
    """

    def __init__(
        self,
        layers: Sequence[Entry],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        mesh: Mesh,
        partition: str | Sequence[int] = "parameters",
        *,
        virtual_stages: int = 1,
        seed: int | None = None,
        plain_names: Mapping[str, str] | None = None,
        materialize: Callable[[nn.Module], None] | None = None,
    ) -> None:
        super().__init__()
        entries = check_entries(layers)
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(output, target) -> loss")
        self.mesh, self.loss_fn, self.virtual_stages = mesh, loss_fn, virtual_stages
        self.pp_size, self.pp_rank = mesh.pp_size, mesh.rank(Axis.PP)
        self.pp_group = mesh.group(Axis.PP)
        self.num_stages = self.pp_size * virtual_stages
        self.bounds = partition_layers(layer_parameter_counts(entries), self.num_stages, partition)
        self.stage_ids = list(range(self.pp_rank, self.num_stages, self.pp_size))
        self.plain_names: dict[str, str] = dict(plain_names or {})
        # Only this rank's entries are kept: another stage's modules (and a tied module this
        # rank does not use) must not stay reachable from here, or every rank would hold them.
        mine = [i for s in self.stage_ids for i in range(self.bounds[s], self.bounds[s + 1])]
        self._entries: dict[int, Entry] = {i: entries[i] for i in mine}
        self._tied_keys = [e.key if isinstance(e, Tied) else None for e in entries]
        self.layers = nn.ModuleDict()
        self.tied = nn.ModuleDict()
        self._tied_first = first_indices(entries)
        for i in mine:
            build_entry(entries, i, self.layers, self.tied, self._tied_first, seed)
        if materialize is not None and any(p.is_meta for p in self.parameters()):
            materialize(self)
        self._tied_groups = self._form_tied_groups()
        self._broadcast_tied()

    def stage_of_layer(self, i: int) -> int:
        return next(s for s in range(self.num_stages) if self.bounds[s] <= i < self.bounds[s + 1])

    def tied_holders(self, key: str) -> list[int]:
        """pp ranks holding ``key``, lowest first (the first holds the saved copy)."""
        stages = {self.stage_of_layer(i) for i, k in enumerate(self._tied_keys) if k == key}
        return sorted({s % self.pp_size for s in stages})

    def _form_tied_groups(self) -> dict[str, comm.Group]:
        """A tied module on every pp rank sums over the pp group. One on some pp ranks gets a
        group of its holders per coordinate off the pp axis, formed on its first collective by
        those holders alone (on MPI, by every rank of the world: only on a mesh over it)."""
        mine: dict[str, comm.Group] = {}
        me, members = self.mesh.world.rank, self.mesh.members
        for key in sorted(self._tied_first):
            holders = self.tied_holders(key)
            if len(holders) < 2:
                continue
            if len(holders) == self.pp_size:
                mine[key] = self.pp_group
                continue
            everyone = self.mesh.world.backend == "mpi"  # no group-local formation there
            if everyone and len(members) != self.mesh.world.world_size:
                raise ValueError(
                    f"tied module {key!r} is held by pp ranks {holders} of {self.pp_size}: its "
                    f"group needs every rank of the world, but the mesh covers ranks "
                    f"{list(members)} of {self.mesh.world.world_size}; build the mesh over the "
                    "whole world, or tie only across all pp ranks"
                )
            for stages in self.mesh.partition(Axis.PP):  # one per coordinate off the pp axis
                ranks = [members[stages[pp]] for pp in holders]
                if me in ranks or everyone:
                    g = self.mesh.world.group_on_use(ranks, f"tied-{key}", self.mesh.stats)
                    if me in ranks:
                        mine[key] = g
        return mine

    def _broadcast_tied(self) -> None:
        for key, g in self._tied_groups.items():
            with torch.no_grad():
                for p in self.tied[key].parameters():
                    if p.is_meta:  # a model built on the meta device: every holder loads its copy
                        continue
                    ops.broadcast(p.data, src=g.ranks[0], group=g)

    def reduce_tied_grads(
        self, grad_of: Callable[[nn.Parameter], torch.Tensor] | None = None
    ) -> None:
        """Sum each tied module's gradients over its holders (one all_reduce per key), in
        place in ``.grad`` or, with ``grad_of``, in the tensor it returns for a parameter."""
        for key, g in self._tied_groups.items():
            grads = []
            for p in self.tied[key].parameters():
                if grad_of is not None:
                    grads.append(grad_of(p))
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            ops.all_reduce_coalesced(grads, op="sum", group=g)

    def stage_style(self, param: torch.Tensor) -> StageOwned:
        """``param``'s placement along pp: this stage's own, or a tied module's copy held by
        the pp ranks ``holders`` (the first holds the saved copy)."""
        for key in self._tied_groups:
            if any(param is p for p in self.tied[key].parameters()):
                return StageOwned(tuple(self.tied_holders(key)))
        return StageOwned()

    def is_tied_copy(self, name: str) -> bool:
        """Whether state-dict key ``name`` belongs to a tied module whose saved copy is on
        another pp rank."""
        return any(
            name.startswith(f"tied.{key}.") and self.tied_holders(key)[0] != self.pp_rank
            for key in self._tied_groups
        )

    def forward_stage(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        """Run ``x`` through the layers of ``stage`` (one of this rank's), as one call of this
        module (its hooks, e.g. ZeRO-3's gathering, see the whole stage)."""
        if stage not in self.stage_ids:
            raise ValueError(f"stage {stage} is not on pp rank {self.pp_rank} ({self.stage_ids})")
        out: torch.Tensor = self(x, stage=stage)
        return out

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """The parameters ``stage`` uses (a tied module's once)."""
        modules: dict[int, nn.Module] = {}
        for i in range(self.bounds[stage], self.bounds[stage + 1]):
            e = self._entries[i]
            m = self.tied[e.key] if isinstance(e, Tied) else self.layers[str(i)]
            modules[id(m)] = m
        seen: dict[int, nn.Parameter] = {}
        for m in modules.values():
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def forward(self, x: Any = None, *, stage: int | None = None) -> torch.Tensor:
        """One stage's layers (called by ``forward_stage``, which checks ``stage``)."""
        if stage is None:
            raise RuntimeError(
                "a PipelineModule runs through a schedule: use shardwise.parallel.pipeline."
                "PipelineExecutor (or forward_stage for one stage)"
            )
        indices = range(self.bounds[stage], self.bounds[stage + 1])
        return run_entries(self._entries, indices, self.layers, self.tied, x)

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under the whole model's names: ``layers.{i}.{name}`` by index in
        ``layers``, ``tied.{key}.{name}`` only on the tied module's first holder (stored once)."""
        out = {f"layers.{k}": v for k, v in self.layers.state_dict().items()}
        for key, module in self.tied.items():
            if self.tied_holders(key)[0] == self.pp_rank:
                out.update({f"tied.{key}.{k}": v for k, v in module.state_dict().items()})
        return out

"""Sequence-parallel boundaries for models that read the sequence length from their inputs.

``sequence_entry``: where a sequence-parallel region starts when it cannot start at the
embedding.
Models such as Hugging Face's Llama derive positions and the causal mask from the length of the
embedding's output, so that output must stay whole. A plan names instead a ``sequence_entry``
module (the first decoder layer): under sequence parallelism its first positional input is split
along the sequence as it is entered, and the vocab embedding all_reduces its output. Every
``sequence`` module must then run after the entry in each forward; one that runs before it
(it would see the whole sequence while its gradient is treated as a 1/tp part) raises.

``whole_sequence``: a module whose own code needs the whole sequence (attention that reshapes
its projections by its input's length) gets its ``hidden_states`` input gathered on entry.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.comm.groups import Group
from shardwise.parallel.tensor import mappings
from shardwise.parallel.tensor.layers import Region


class SequenceEntries:
    """The plan's ``sequence_entry`` modules on one model, and whether this forward passed one."""

    def __init__(self, model: nn.Module, group: Group, names: list[str]) -> None:
        self.group = group
        self.names = names
        self.entered = False
        modules = dict(model.named_modules())
        model.register_forward_pre_hook(self._reset)
        for name in names:
            modules[name].register_forward_pre_hook(self._hook_for(name), with_kwargs=True)

    def _reset(self, module: nn.Module, args: Any) -> None:
        self.entered = False

    def _hook_for(self, name: str) -> Any:
        def split_first_input(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            x = first_input(name, "sequence_entry", args, kwargs)
            self.entered = True
            return replace_first_input(args, kwargs, mappings.split_sequence(x, self.group))

        return split_first_input

    def check_inside(self, name: str) -> None:
        """Raise if the ``sequence`` module ``name`` runs before this forward's entry."""
        if not self.entered:
            raise RuntimeError(
                f"module {name!r} ('sequence') ran before the plan's 'sequence_entry' module "
                f"({', '.join(map(repr, self.names))}): it would see the whole sequence; under "
                "sequence parallelism every 'sequence' module must run after the entry"
            )


def first_input(name: str, style: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The sequence a ``style`` module was called with: its first positional input, or its
    ``hidden_states`` keyword."""
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise ValueError(
        f"module {name!r} ({style!r}) was called without a positional or hidden_states input: "
        "it must receive the [batch, seq, hidden] sequence that way"
    )


def replace_first_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def gather_on_entry(module: nn.Module, name: str, region: Region) -> None:
    """Under sequence parallelism: ``module`` receives the whole sequence (see the module doc)."""

    def gather(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = first_input(name, "whole_sequence", args, kwargs)
        return replace_first_input(args, kwargs, region.enter_whole(x))

    module.register_forward_pre_hook(gather, with_kwargs=True)

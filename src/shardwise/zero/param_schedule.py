"""Stage 3: gather each unit's parameters just before they are used, free them right after.

Forward: a unit's pre-hook all-gathers its flat buffers (and those of units whose parameters it
shares), then starts the all_gather of the next unit in the recorded forward order so that it
overlaps this unit's compute; the post-hook frees them once every module that needs them has run.
Backward: hooks on the unit's outputs gather it again just before its backward (prefetching the
unit that comes next in backward); the gradient reducer frees it once its gradients have been
reduced. ZeRO paper, section 5.3 (P_os+g+p).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.recompute import is_recomputing
from shardwise.zero.flat_param import FlatParam


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


class ParamSchedule:
    """Forward/backward hooks that move stage-3 units between sharded and full."""

    def __init__(
        self, modules: list[nn.Module], needs: list[list[FlatParam]], prefetch: int = 1
    ) -> None:
        self.needs = {id(m): n for m, n in zip(modules, needs)}
        self.prefetch = prefetch
        self._users: dict[int, int] = {}
        for n in needs:
            for f in n:
                self._users[id(f)] = self._users.get(id(f), 0) + 1
        self._done: dict[int, int] = {}
        self.order: list[nn.Module] = []  # forward order, recorded on the first forward
        self._recording = True
        self._seen_bwd: set[int] = set()
        self.in_backward = False
        self._hooks = []
        for m in modules:
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(m.register_forward_hook(self._post_forward))

    def _gather(self, module: nn.Module) -> None:
        for f in self.needs[id(module)]:
            f.gather(async_op=True)
        for f in self.needs[id(module)]:
            f.wait_gather()

    def _prefetch_after(self, module: nn.Module, backward: bool) -> None:
        if self._recording or not self.prefetch or module not in self.order:
            return
        order = self.order[::-1] if backward else self.order
        i = order.index(module)
        for nxt in order[i + 1 : i + 1 + self.prefetch]:
            for f in self.needs[id(nxt)]:
                f.gather(async_op=True)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._gather(module)
        if self.in_backward or is_recomputing():
            return
        if self._recording and module not in self.order:
            self.order.append(module)
        self._prefetch_after(module, backward=False)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.in_backward or is_recomputing():
            return output  # a recompute inside backward: the backward frees the unit
        for f in self.needs[id(module)]:
            self._done[id(f)] = self._done.get(id(f), 0) + 1
            if self._done[id(f)] >= self._users[id(f)]:
                self._done[id(f)] = 0
                f.release()
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._make_pre_backward(module))
        return output

    def _make_pre_backward(self, module: nn.Module):
        def hook(grad: torch.Tensor) -> None:
            self.in_backward = True
            if id(module) not in self._seen_bwd:
                self._seen_bwd.add(id(module))
                self._gather(module)
                self._prefetch_after(module, backward=True)

        return hook

    def finish_forward_recording(self) -> None:
        self._recording = False

    def finish_backward(self, flats: list[FlatParam]) -> None:
        """After backward: every unit back to its shard."""
        self.in_backward = False
        self._seen_bwd.clear()
        self._done.clear()
        for f in flats:
            f.release()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

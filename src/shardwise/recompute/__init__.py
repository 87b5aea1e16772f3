"""Activation checkpointing: keep a region's inputs in forward, recompute the rest in backward.

`checkpoint` and `checkpoint_sequential` checkpoint a call site; they are thin layers over
PyTorch's non-reentrant `torch.utils.checkpoint.checkpoint`. `apply_activation_checkpointing`
checkpoints every submodule of chosen classes from outside the model, with one forward pre-hook
and one forward hook per module: model code, parameter names and state_dict keys stay as they
are, and no class is patched.

A hooked region: the pre-hook keeps the module's inputs (detached aliases, no copy), the RNG and
autocast state, and installs `torch.autograd.graph.saved_tensors_hooks` whose pack hook keeps only
a small slot object per tensor autograd wants to save; the forward hook closes the region. When
backward first unpacks an empty slot, the region calls the module again through
`nn.Module.__call__` under the restored RNG and autocast state, so every hook on the module fires
again (a ZeRO-3 engine that gathers a unit's parameters in its pre-hook and frees them in its
forward hook has them for the recompute). In that call the region's own pre-hook installs a
recording hook that refills the slots, in forward order. A slot hands its tensor to autograd once
and forgets it, so memory is given back as backward proceeds; a second backward over a retained
graph recomputes again.

Nothing here communicates.
"""

from shardwise.recompute.call_site import checkpoint, checkpoint_sequential
from shardwise.recompute.module_hooks import (
    apply_activation_checkpointing,
    is_recomputing,
    remove_activation_checkpointing,
)

__all__ = [
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "remove_activation_checkpointing",
]

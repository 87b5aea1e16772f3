"""What context parallelism costs per device and step: the bytes each cp rank sends, their
seconds, and the activations it keeps.

Each cp rank holds 1/cp of every sequence (``shardwise.parallel.context``), so compute,
activations and the other axes' activation messages scale by 1/cp; attention alone needs the
other ranks' keys and values. Per transformer layer and micro-batch, with ``local`` the bytes of
this rank's [micro_batch, seq / cp, hidden / tp] activation:

- ring: the forward passes this rank's K and V to the next rank cp - 1 times, (cp - 1)/cp of
  the sequence's K and V; the backward passes K, V and their gradients again (twice that);
- all_to_all (DeepSpeed-Ulysses): four all-to-alls of ``local`` forward (Q, K, V in, the output
  back), four backward (their gradients);
- recomputation (selective or full) replays the forward's messages once more.

These are the bytes ``shardwise.comm`` counts for the cp axis (a send's message, an
all_to_all's local tensor). They are priced without overlap (an upper bound: the ring overlaps
each block's send with its attention).
"""

from __future__ import annotations

from shardwise.costmodel.hardware import Hardware
from shardwise.costmodel.plan import PRECISIONS, Plan
from shardwise.costmodel.shapes import ModelShape


def local_activation_bytes(shape: ModelShape, plan: Plan, width: int | None = None) -> float:
    """Bytes of one rank's [micro_batch, seq_len / cp, width / tp] activation (``width``
    default: the hidden size)."""
    width = shape.hidden if width is None else width
    tokens = plan.micro_batch * shape.seq_len / plan.cp
    return tokens * width / plan.tp * PRECISIONS[plan.precision]


def _forward_passes(plan: Plan) -> int:
    """How often a micro-batch's attention runs its forward messages: once, or twice when
    recomputation replays it in the backward."""
    return 1 if plan.recompute == "none" else 2


def cp_bytes_per_layer(shape: ModelShape, plan: Plan) -> float:
    """Bytes one cp rank sends per transformer layer and micro-batch, forward and backward
    (see the module docstring); 0 without context parallelism."""
    if plan.cp == 1:
        return 0.0
    if plan.cp_method == "ring":
        kv_local = 2 * local_activation_bytes(shape, plan, shape.kv_hidden)  # K and V
        return (_forward_passes(plan) + 2) * (plan.cp - 1) * kv_local
    q_local = local_activation_bytes(shape, plan)
    kv_local = local_activation_bytes(shape, plan, shape.kv_hidden)
    forward = 2 * q_local + 2 * kv_local  # Q and the output; K and V
    return (_forward_passes(plan) + 1) * forward


def cp_seconds_per_layer(shape: ModelShape, plan: Plan, hw: Hardware) -> float:
    """Seconds of one layer's cp messages for one micro-batch: ring steps of send/recv between
    neighbours, or all-to-alls over cp ((cp - 1) rounds of 1/cp of the tensor each)."""
    if plan.cp == 1:
        return 0.0
    link = hw.link(plan.tp, plan.cp)  # cp ranks are tp apart in the mesh
    if plan.cp_method == "ring":
        kv_local = 2 * local_activation_bytes(shape, plan, shape.kv_hidden)
        steps = (_forward_passes(plan) + 2) * (plan.cp - 1)
        return steps * link.seconds(int(kv_local))
    messages = 4 * (_forward_passes(plan) + 1)
    per = cp_bytes_per_layer(shape, plan) / messages  # mean local tensor of an all_to_all
    rounds = plan.cp - 1
    return messages * rounds * (link.alpha_s + per / plan.cp * link.beta_s_per_byte)

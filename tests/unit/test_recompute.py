"""Activation checkpointing: same gradients as the plain run, fewer saved activations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from shardwise.recompute import (
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_sequential,
    is_recomputing,
    remove_activation_checkpointing,
)

torch.set_num_threads(1)

HIDDEN = 32
DEPTH = 8
BATCH = 16


class Block(nn.Module):
    """Pre-norm residual MLP block with dropout."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


class ResidualMLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN, depth: int = DEPTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model() -> ResidualMLP:
    torch.manual_seed(0)
    return ResidualMLP()


def make_input(requires_grad: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, HIDDEN, generator=generator).requires_grad_(requires_grad)


def grad_of(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.grad is not None
    return tensor.grad.clone()


def grads_of(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of one forward/backward with dropout seeded identically."""
    model.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None
    torch.manual_seed(123)
    model(x).square().mean().backward()
    grads = {name: grad_of(p) for name, p in model.named_parameters()}
    if x.requires_grad:
        grads["input"] = grad_of(x)
    return grads


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@contextmanager
def saved_storages(exclude: list[nn.Parameter]) -> Iterator[dict[int, torch.Tensor]]:
    """Storages autograd saves in the body (parameters excluded), keyed by address."""
    excluded = {p.untyped_storage().data_ptr() for p in exclude}
    storages: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in excluded:
            storages[pointer] = tensor
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        yield storages


def storage_bytes(storages: dict[int, torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in storages.values())


# ---------------------------------------------------------------------------------------------
# checkpoint / checkpoint_sequential
# ---------------------------------------------------------------------------------------------


def test_checkpoint_matches_plain_mlp_with_dropout() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    x = torch.randn(6, 8, requires_grad=True)

    class Wrapped(nn.Module):
        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return checkpoint(mlp, inp)

    plain = grads_of(mlp, x)
    wrapped = Wrapped()
    wrapped.add_module("mlp", mlp)
    checkpointed = grads_of(wrapped, x)
    assert_bitwise_equal(plain, {k.removeprefix("mlp."): v for k, v in checkpointed.items()})


def test_checkpoint_passes_keyword_arguments_and_non_grad_inputs() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    drop = nn.Dropout(0.5)
    x = torch.randn(3, 4)  # no grad: only the parameters and `bias` need gradients
    bias = torch.randn(4, requires_grad=True)

    def fn(inp: torch.Tensor, *, scale: float, bias: torch.Tensor, debug: bool) -> torch.Tensor:
        assert debug is True  # a name torch's checkpoint also uses must still reach fn
        return drop(torch.tanh(linear(inp) * scale + bias))

    def run(use_checkpoint: bool) -> list[torch.Tensor]:
        linear.zero_grad(set_to_none=True)
        bias.grad = None
        torch.manual_seed(7)
        if use_checkpoint:
            out = checkpoint(fn, x, scale=2.0, bias=bias, debug=True)
        else:
            out = fn(x, scale=2.0, bias=bias, debug=True)
        out.sum().backward()
        return [grad_of(linear.weight), grad_of(linear.bias), grad_of(bias)]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("segments", [1, 3, 6])
@pytest.mark.parametrize("checkpoint_last", [False, True])
def test_checkpoint_sequential_matches_plain(segments: int, checkpoint_last: bool) -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2)
    )
    x = torch.randn(5, 8, requires_grad=True)

    class Runner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return checkpoint_sequential(
                self.layers, segments, inp, checkpoint_last=checkpoint_last
            )

    plain = grads_of(layers, x)
    runner = grads_of(Runner(), x)
    assert_bitwise_equal(plain, {k.removeprefix("layers."): v for k, v in runner.items()})


@pytest.mark.parametrize("segments", [0, 7, -1, True, 2.0])
def test_checkpoint_sequential_rejects_bad_segments(segments: Any) -> None:
    layers = [nn.Linear(2, 2) for _ in range(6)]
    with pytest.raises(ValueError, match="segments"):
        checkpoint_sequential(layers, segments, torch.randn(1, 2))


def test_checkpoint_sequential_rejects_empty() -> None:
    with pytest.raises(ValueError, match="at least one module"):
        checkpoint_sequential([], 1, torch.randn(1, 2))


# ---------------------------------------------------------------------------------------------
# apply_activation_checkpointing
# ---------------------------------------------------------------------------------------------


def test_apply_gives_bitwise_equal_grads_and_keeps_state_dict_keys() -> None:
    model = make_model()
    x = make_input(requires_grad=True)
    keys = list(model.state_dict())
    plain = grads_of(model, x)

    assert apply_activation_checkpointing(model, ["Block"]) == DEPTH
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == [n for n in plain if n != "input"]
    assert_bitwise_equal(plain, grads_of(model, x))


def test_apply_lowers_saved_activation_bytes() -> None:
    model = make_model()
    x = make_input()
    params = list(model.parameters())

    def measure() -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        torch.manual_seed(123)
        with saved_storages(params) as storages:
            loss = model(x).square().mean()
        return storages, loss

    plain, loss = measure()
    loss.backward()

    apply_activation_checkpointing(model, [Block])
    # A checkpointed block keeps its input alive for the recompute: count those too.
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        block.register_forward_pre_hook(
            lambda _m, args: inputs.setdefault(args[0].untyped_storage().data_ptr(), args[0])
        )
        for block in model.blocks
    ]
    saved, loss = measure()
    for handle in handles:
        handle.remove()
    kept = {**saved, **inputs}  # union by storage: a tensor counts once
    loss.backward()

    plain_bytes, saved_bytes, kept_bytes = map(storage_bytes, (plain, saved, kept))
    print(
        f"activation bytes: plain {plain_bytes}; checkpointed {saved_bytes} saved by autograd, "
        f"{kept_bytes} with the block inputs kept for recompute"
    )
    assert kept_bytes < 0.4 * plain_bytes


def test_apply_is_idempotent_and_removable() -> None:
    model = make_model()
    x = make_input()
    plain = grads_of(model, x)
    assert apply_activation_checkpointing(model, ["Block"]) == DEPTH
    assert apply_activation_checkpointing(model, [Block]) == 0
    calls: list[bool] = []
    model.blocks[0].register_forward_pre_hook(lambda _m, _a: calls.append(is_recomputing()))
    assert_bitwise_equal(plain, grads_of(model, x))
    assert calls == [False, True]  # one forward, one recompute: not wrapped twice

    assert remove_activation_checkpointing(model) == DEPTH
    calls.clear()
    assert_bitwise_equal(plain, grads_of(model, x))
    assert calls == [False]


def test_retained_graph_recomputes_for_each_backward() -> None:
    model = make_model()
    x = make_input(requires_grad=True)
    apply_activation_checkpointing(model, ["Block"])
    torch.manual_seed(3)
    loss = model(x).square().mean()
    params = list(model.parameters())
    first = torch.autograd.grad(loss, [x, *params], retain_graph=True)
    only_input = torch.autograd.grad(loss, [x], retain_graph=True)
    second = torch.autograd.grad(loss, [x, *params])
    assert torch.equal(only_input[0], first[0])
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_forward_that_raises_closes_its_region() -> None:
    model = make_model()
    x = make_input()
    plain = grads_of(model, x)
    apply_activation_checkpointing(model, ["Block"])

    def fail(_m: nn.Module, _args: Any, _out: Any) -> None:
        raise RuntimeError("boom")

    block = model.blocks[3]
    assert isinstance(block, Block)
    handle = block.fc1.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    handle.remove()
    calls: list[bool] = []
    model.blocks[0].register_forward_pre_hook(lambda _m, _a: calls.append(is_recomputing()))
    assert_bitwise_equal(plain, grads_of(model, x))
    assert calls == [False, True]  # a region left open would have swallowed this one


def test_nested_targets_are_covered_by_the_outer_region() -> None:
    model = make_model()
    x = make_input(requires_grad=True)
    plain = grads_of(model, x)
    # Blocks, the Linears inside them, and the head Linear outside any block.
    assert apply_activation_checkpointing(model, [Block, nn.Linear]) == DEPTH * 3 + 1
    assert_bitwise_equal(plain, grads_of(model, x))


def test_recompute_runs_under_the_forward_autocast_state() -> None:
    model = make_model()
    x = make_input()

    def autocast_grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()  # outside autocast, as in a training loop
        return {n: grad_of(p) for n, p in model.named_parameters()}

    plain = autocast_grads()
    apply_activation_checkpointing(model, ["Block"])
    assert_bitwise_equal(plain, autocast_grads())


def test_unknown_class_name_lists_model_classes() -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"'Blok'.*Block.*LayerNorm"):
        apply_activation_checkpointing(model, ["Block", "Blok"])
    assert remove_activation_checkpointing(model) == 0  # validation happens before wrapping
    with pytest.raises(ValueError, match="Conv2d"):
        apply_activation_checkpointing(model, [nn.Conv2d])
    with pytest.raises(TypeError, match="sequence"):
        apply_activation_checkpointing(model, "Block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        apply_activation_checkpointing(model, [])


# ---------------------------------------------------------------------------------------------
# Hooks from other code fire again during the recompute (ZeRO-3 style gather / free)
# ---------------------------------------------------------------------------------------------


class GatheredLinear(nn.Module):
    """Linear whose full weight exists only between a pre-hook ("gather") and a hook ("free")."""

    def __init__(self, features: int, full: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.flat_weight = nn.Parameter(torch.randn(features * features) / features)
        self.features = features
        self.full = full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.full[id(self)]  # KeyError if the gather hook did not run
        return torch.tanh(x @ weight.t())


def build_gathered(hooks_first: bool) -> tuple[nn.Sequential, list[tuple[str, bool]]]:
    torch.manual_seed(0)
    full: dict[int, torch.Tensor] = {}
    events: list[tuple[str, bool]] = []
    model = nn.Sequential(*(GatheredLinear(6, full) for _ in range(3)))

    def gather(module: GatheredLinear, _args: Any) -> None:
        full[id(module)] = module.flat_weight.view(module.features, module.features)
        events.append(("gather", is_recomputing()))

    def free(module: GatheredLinear, _args: Any, _out: Any) -> None:
        del full[id(module)]
        events.append(("free", is_recomputing()))

    def register() -> None:
        for layer in model:
            layer.register_forward_pre_hook(gather)
            layer.register_forward_hook(free)

    if hooks_first:
        register()
        apply_activation_checkpointing(model, [GatheredLinear])
    else:
        apply_activation_checkpointing(model, [GatheredLinear])
        register()
    return model, events


@pytest.mark.parametrize("hooks_first", [False, True])
def test_other_forward_hooks_fire_again_during_recompute(hooks_first: bool) -> None:
    model, events = build_gathered(hooks_first)
    x = torch.randn(4, 6, requires_grad=True)
    checkpointed = grads_of(model, x)
    forward, backward = events[:6], events[6:]
    assert forward == [("gather", False), ("free", False)] * 3
    assert backward == [("gather", True), ("free", True)] * 3  # one recompute per layer

    remove_activation_checkpointing(model)
    events.clear()
    assert_bitwise_equal(grads_of(model, x), checkpointed)
    assert len(events) == 6  # without checkpointing, nothing runs again in backward

"""Activation checkpointing on a model with an HF-style key/value cache (``config.use_cache``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from shardwise.recompute import apply_activation_checkpointing, remove_activation_checkpointing


@dataclass
class CacheConfig:
    use_cache: bool = True


class CachedAttention(nn.Module):
    """Appends its keys to ``cache`` when the model's config says so, as HF decoders do."""

    def __init__(self, config: CacheConfig, cache: list[torch.Tensor]) -> None:
        super().__init__()
        self.config, self.cache = config, cache
        self.k = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        k = self.k(h)
        if self.config.use_cache:
            self.cache.append(k)
            k = torch.cat(self.cache, dim=1)
        return h + torch.softmax(h @ k.transpose(1, 2), -1) @ k


class CachedModel(nn.Module):
    def __init__(self, use_cache: bool) -> None:
        super().__init__()
        self.config = CacheConfig(use_cache)
        self.cache: list[torch.Tensor] = []
        self.layers = nn.ModuleList(CachedAttention(self.config, self.cache) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.cache.clear()
        for layer in self.layers:
            h = layer(h)
        return h.square().mean()


def test_checkpointing_a_model_with_a_cache_is_refused_naming_use_cache():
    model = CachedModel(use_cache=True)
    with pytest.raises(ValueError, match=r"model\.config\.use_cache = False"):
        apply_activation_checkpointing(model, ["CachedAttention"])
    assert remove_activation_checkpointing(model) == 0  # nothing was hooked


def test_with_use_cache_false_checkpointing_trains_exactly():
    torch.manual_seed(0)
    plain = CachedModel(use_cache=False)
    hooked = CachedModel(use_cache=False)
    hooked.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(hooked, ["CachedAttention"]) == 2
    x = torch.randn(2, 3, 8)
    plain(x).backward()
    hooked(x).backward()
    for a, b in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(a.grad, b.grad)

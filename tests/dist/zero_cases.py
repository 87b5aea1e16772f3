"""Models, data and single-process references shared by the ZeRO tests.

Every rank builds the same model from the same seed; the reference trains it in one process on
the same global batch, each rank's part as one micro-batch, with the loss averaged over the
global batch exactly as the engine averages it (sum of per-part losses / number of parts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import shardwise
from shardwise.models import GPT, GPTConfig

# A 16-token vocabulary so every token occurs in every batch: an embedding row no token uses
# gets a gradient that is only rounding noise. No biases: the key projection's bias has an exactly-zero true gradient (softmax ignores a
# constant shift), so its computed gradient is rounding noise that Adam scales up to lr-sized
# steps; comparing it across summation orders would test rounding, not sharding.
GPT_CFG = GPTConfig(vocab_size=16, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False)


def make_gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPT_CFG)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.features(x).flatten(1))
        return nn.functional.cross_entropy(logits, y)


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN()


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt": make_gpt, "cnn": make_cnn}


def batches(kind: str, steps: int, parts: int, micro: int = 2) -> list[list[tuple]]:
    """``steps`` global batches, each a list of ``parts`` micro-batches (x, y)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(parts):
            if kind == "gpt":
                t = torch.randint(0, GPT_CFG.vocab_size, (micro, GPT_CFG.seq_len + 1), generator=g)
                step.append((t[:, :-1], t[:, 1:]))
            else:
                step.append((torch.randn(micro, 3, 8, 8, generator=g),
                             torch.randint(0, 5, (micro,), generator=g)))
        out.append(step)
    return out


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two groups: decay for matrices, none for norms and biases."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    # eps 1e-6: Adam divides by sqrt(v) + eps, so an element whose gradient is rounding noise
    # far below eps would turn that noise into lr-sized steps; with a larger eps the comparison
    # tests sharding, not the summation order of fp32 rounding errors.
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    if kind == "adamw_groups":
        return torch.optim.AdamW(param_groups(model), lr=1e-3, eps=1e-6)
    if kind == "sgd":
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                               momentum=0.9)
    raise ValueError(kind)


def freeze_first_layer(model: nn.Module) -> None:
    first = model.blocks[0] if hasattr(model, "blocks") else model.features[0]
    for p in first.parameters():
        p.requires_grad_(False)


def reference(model_kind: str, opt_kind: str, world: int, steps: int, accum: int,
              clip: float | None, frozen: bool) -> tuple[list[float], dict, list[float]]:
    """Single-process training: losses per step, final state, gradient norms per step."""
    model = MODELS[model_kind]()
    if frozen:
        freeze_first_layer(model)
    opt = make_optimizer(model, opt_kind)
    losses, norms = [], []
    for parts in batches(model_kind, steps, world * accum):
        total = 0.0
        for x, y in parts:
            loss = model(x, y) / len(parts)
            loss.backward()
            total += loss.item()
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            params, clip if clip is not None else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, norms


def train_on_rank(model_kind: str, opt_kind: str, stage: int, steps: int, accum: int,
                  clip: float | None, frozen: bool) -> tuple[list[float], dict, list[float]]:
    """The same training through the engine on this rank (run inside a rank pool)."""
    torch.set_num_threads(1)
    world, rank = shardwise.world_size(), shardwise.rank()
    model = MODELS[model_kind]()
    if frozen:
        freeze_first_layer(model)
    cfg = shardwise.Config(zero_stage=stage, gradient_accumulation_steps=accum,
                           gradient_clipping=clip, reduce_bucket_bytes=4096)
    engine = shardwise.initialize(model, make_optimizer(model, opt_kind), cfg)
    losses, norms = [], []
    for parts in batches(model_kind, steps, world * accum):
        total = torch.zeros(())
        for a in range(accum):
            x, y = parts[rank * accum + a]
            loss = engine(x, y)
            engine.backward(loss)
            total += loss.detach() / (world * accum)
        engine.step()
        shardwise.all_reduce(total)
        losses.append(total.item())
        norms.append(engine.grad_norm)
    return losses, engine.state_dict(), norms

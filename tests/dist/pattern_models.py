"""Small models that call their parts the way models written elsewhere do, for the ZeRO tests.

- ``dataclass`` / ``namedtuple`` / ``object``: the middle unit returns its hidden state inside a
  dataclass, a NamedTuple or a plain object.
- ``tied``: a tied head computed as ``F.linear(h, self.emb.weight)`` in the root's forward.
- ``wrapper``: a wrapper whose forward calls the inner model directly (as peft's PeftModel does
  without a task type), bypassing the module that holds it.
- ``encdec``: an encoder-decoder with one embedding shared by encoder, decoder and head (tied),
  whose greedy ``generate`` calls ``get_encoder()(...)`` directly and then the model per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, SEQ = 12, 16, 6


@dataclass
class HiddenDC:
    hidden: torch.Tensor
    aux: torch.Tensor


class HiddenNT(NamedTuple):
    hidden: torch.Tensor
    aux: torch.Tensor


class HiddenObj:
    def __init__(self, hidden: torch.Tensor, aux: torch.Tensor) -> None:
        self.hidden, self.aux = hidden, aux


class Mid(nn.Module):
    def __init__(self, box: type) -> None:
        super().__init__()
        self.box = box
        self.fc = nn.Linear(D, D)
        self.gate = nn.Linear(D, D, bias=False)

    def forward(self, h: torch.Tensor):
        return self.box(torch.tanh(self.fc(h)) * torch.sigmoid(self.gate(h)), self.gate(h).mean())


class BoxedOutputs(nn.Module):
    def __init__(self, box: type) -> None:
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.mid = Mid(box)
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.mid(torch.relu(self.inp(x)))
        return F.mse_loss(self.out(o.hidden), y) + 0.1 * o.aux**2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class TiedFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        logits = F.linear(self.norm(h), self.emb.weight)  # [batch, seq, vocab]
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Adapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = TiedFunctional()
        self.scale = nn.Parameter(torch.ones(D))


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_model = Adapter()

    def get_base_model(self) -> nn.Module:
        return self.base_model.model

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.get_base_model()(idx, y) + 0.01 * self.base_model.scale.square().sum()


class Stack(nn.Module):
    def __init__(self, embed: nn.Embedding, cross: bool) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.cross = nn.Linear(D, D) if cross else None
        self.final_norm = nn.LayerNorm(D)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(ids)
        if memory is not None:
            assert self.cross is not None
            h = h + self.cross(memory.mean(1, keepdim=True))
        for layer in self.layers:
            h = layer(h)
        return self.final_norm(h)


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, D)
        self.encoder = Stack(self.shared, cross=False)
        self.decoder = Stack(self.shared, cross=True)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.shared.weight

    def get_encoder(self) -> nn.Module:
        return self.encoder

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        labels: torch.Tensor | None = None,
        encoder_outputs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        memory = self.encoder(src) if encoder_outputs is None else encoder_outputs
        logits = self.lm_head(self.decoder(tgt, memory))  # [batch, tgt, vocab]
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    @torch.no_grad()
    def generate(self, src: torch.Tensor, steps: int) -> torch.Tensor:
        memory = self.get_encoder()(src)
        out = torch.zeros(src.shape[0], 1, dtype=torch.long)
        for _ in range(steps):
            logits = self(src, out, encoder_outputs=memory)[:, -1]
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
        return out


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    boxes = {"dataclass": HiddenDC, "namedtuple": HiddenNT, "object": HiddenObj}
    if kind in boxes:
        return BoxedOutputs(boxes[kind])
    return {"tied": TiedFunctional, "wrapper": Wrapper, "encdec": EncDec}[kind]()


def batch(kind: str, step: int, part: int) -> tuple[torch.Tensor, ...]:
    """Micro-batch ``part`` of global step ``step``: the same on every rank and the reference."""
    g = torch.Generator().manual_seed(1000 * step + part)
    if kind in ("dataclass", "namedtuple", "object"):
        return torch.randn(3, 4, generator=g), torch.randn(3, 3, generator=g)
    if kind == "encdec":
        src = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        tgt = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        return src, tgt[:, :-1], tgt[:, 1:]
    t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)

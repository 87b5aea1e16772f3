"""Transformer shapes the cost model prices: parameter counts and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.models.gpt import GPTConfig


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer.

    ``kv_heads`` < ``heads`` is grouped-query attention; ``mlp_matrices`` is 2 for a GELU MLP
    and 3 for a gated one (SwiGLU); ``tied_embeddings`` shares the input and output matrices.
    ``trainable`` is the share of the parameters the optimizer trains (LoRA: its adapters'); the
    rest are frozen weights, with no gradient, optimizer state or reduction. ``other_params``
    corrects the formula's count to a real model's, counted with the embeddings: biases and
    position tables it leaves out (positive), norms without biases it counts (negative).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int = 0  # 0: 4 * hidden
    kv_heads: int = 0  # 0: heads
    mlp_matrices: int = 2
    tied_embeddings: bool = False
    trainable: float = 1.0
    other_params: int = 0

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "vocab", "seq_len"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelShape.{f} must be >= 1, got {getattr(self, f)}")
        if not 0.0 < self.trainable <= 1.0:
            raise ValueError(f"ModelShape.trainable must be in (0, 1], got {self.trainable}")
        if self.embedding_params() < 1:
            raise ValueError(f"ModelShape.other_params {self.other_params} leaves no embeddings")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must divide by heads {self.heads}")
        if self.mlp_matrices not in (2, 3):
            raise ValueError(f"mlp_matrices must be 2 or 3, got {self.mlp_matrices}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv_hidden(self) -> int:
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    def layer_params(self) -> int:
        h = self.hidden
        attn = h * (h + 2 * self.kv_hidden) + h * h
        return attn + self.mlp_matrices * h * self.ffn + 4 * h  # + two norms (weight, bias)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.other_params

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params()

    def layer_forward_flops_per_token(self) -> int:
        """Matmul FLOPs of one layer's forward per token: projections, QK^T and AV, MLP."""
        h, s = self.hidden, self.seq_len
        proj = 2 * (h * (h + 2 * self.kv_hidden) + h * h)
        return proj + 4 * s * h + 2 * self.mlp_matrices * h * self.ffn

    def forward_flops_per_token(self) -> int:
        """One token's forward: every layer plus the output logits (2 h V)."""
        return self.layers * self.layer_forward_flops_per_token() + 2 * self.hidden * self.vocab

    def model_flops_per_token(self) -> int:
        """Training FLOPs per token without recomputation (forward + 2x backward): what MFU
        counts. For GPT (ffn 4h, no GQA) this is Narayanan et al.'s 72 L h^2 (1 + s/6h) + 6hV
        per token."""
        return 3 * self.forward_flops_per_token()


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, vocab=51200, seq_len=2048)


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, vocab, 8192, ffn, 8, 3)


PRESETS: dict[str, ModelShape] = {
    # Narayanan et al. 2021 (arXiv 2104.04473), Table 1: vocab 51200, sequence 2048
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-18b": _gpt("gpt-18b", 40, 6144, 48),
    "gpt-145b": _gpt("gpt-145b", 80, 12288, 96),
    "gpt-175b": _gpt("gpt-175b", 96, 12288, 96),
    "gpt-310b": _gpt("gpt-310b", 96, 16384, 128),
    "gpt-530b": _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
    # Llama 2 7B (Touvron et al. 2023), sequence 4096
    "7b": ModelShape("7b", 32, 4096, 32, 32000, 4096, 11008, 0, 3),
    # Llama 3.1 (Meta's model cards): GQA with 8 KV heads, SwiGLU; torchtitan trains at 8192
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 14336, 128256),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 28672, 128256),
}


def gpt_shape(name: str, cfg: GPTConfig) -> ModelShape:
    """The shape of shardwise's built-in GPT with config ``cfg`` (tied embeddings)."""
    c = cfg
    return ModelShape(
        name, c.n_layer, c.d_model, c.n_head, c.vocab_size, c.seq_len, tied_embeddings=True
    )


def shape(name: str) -> ModelShape:
    """A preset above, or shardwise's built-in GPT sizes (``tiny`` .. ``gpt2``)."""
    if name in PRESETS:
        return PRESETS[name]
    from shardwise.models.gpt import MODEL_SIZES

    if name in MODEL_SIZES:
        return gpt_shape(name, MODEL_SIZES[name])
    names = sorted([*PRESETS, *MODEL_SIZES])
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(names)}")

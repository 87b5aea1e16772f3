"""A GPT-style decoder-only transformer with pre-LayerNorm blocks and a tied output head.

The model is plain single-device PyTorch: parallelism (pipeline split, tensor parallel,
recompute, ZeRO) is applied from outside by the ``apply_*`` functions. Blocks live in
``GPT.blocks`` so those functions can find and wrap them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int
    """Number of token ids the embedding and the output head cover."""
    seq_len: int
    """Longest context in tokens (rows of the position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings and on each residual branch, in [0, 1)."""
    bias: bool = True
    """Whether linear layers and layer norms carry a bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: set it to an int >= 1")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                "choose n_head dividing d_model"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout}: set it in [0, 1)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head

    @classmethod
    def named(cls, name: str, **overrides: Any) -> GPTConfig:
        """Return the preset ``name`` from ``MODEL_SIZES`` with ``overrides`` applied.

        Raises ``ValueError`` listing the preset names when ``name`` is unknown.
        """
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}: choose one of {sorted(MODEL_SIZES)}")
        return dataclasses.replace(MODEL_SIZES[name], **overrides)

    def param_count(self) -> int:
        """Number of distinct parameters of ``GPT(self)``, computed without building it.

        Counts token and position embeddings, all blocks and the final norm; the output head
        shares the token embedding's weight and adds nothing.
        """
        d, b = self.d_model, int(self.bias)
        norm = d + b * d
        attn = 4 * (d * d + b * d)
        mlp = (d * 4 * d + b * 4 * d) + (4 * d * d + b * d)
        block = 2 * norm + attn + mlp
        return self.vocab_size * d + self.seq_len * d + self.n_layer * block + norm


MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64),
    "small": GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128),
    "medium": GPTConfig(vocab_size=256, seq_len=256, n_layer=6, n_head=8, d_model=384),
    "anchor": GPTConfig(vocab_size=8192, seq_len=256, n_layer=6, n_head=8, d_model=512),
    "gpt2": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
}
"""Named model presets, selectable with ``GPTConfig.named``."""


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions.

    Query, key and value have separate projections so tensor parallelism can split each one by
    heads without reordering a fused weight.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = t.shape
        # [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]; the head count comes
        # from the width, so a tensor-parallel projection holding some of the heads works too
        return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` [batch, seq, d_model]; returns [batch, seq, d_model]."""
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, seq, hd]
        y = y.transpose(1, 2).flatten(2)  # [batch, seq, heads * head_dim]
        return self.out_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network: widen 4x, GELU, project back."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transform ``x`` [batch, seq, d_model]; returns the same shape."""
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` [batch, seq, d_model]; returns the same shape."""
        x = x + self.drop(self.attn(self.ln_attn(x)))
        return x + self.drop(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    """Decoder-only language model.

    Token and learned position embeddings feed ``cfg.n_layer`` blocks and a final LayerNorm;
    the output head reuses the token embedding's weight (one shared ``nn.Parameter``).
    Weights are initialised in ``__init__`` from the global torch RNG, so seeding it first
    makes construction reproducible.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialize ``module`` (named ``name`` in this model), its own parameters only: the
        constructor calls it on every module in order; a model built on the meta device is
        initialized through it one module at a time (``shardwise.deferred_init``)."""
        # Each residual branch adds to the stream, so its output projection is scaled down by
        # 1/sqrt(2 * n_layer) to keep the stream's variance flat with depth (GPT-2 paper, sec. 2.3).
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        if module is self.head:
            return  # its weight is the token embedding's, initialised once there
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith(("out_proj", "fc_out")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head weight is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model on token ids ``idx`` (int64 [batch, seq], seq <= ``cfg.seq_len``).

        Returns logits [batch, seq, vocab_size] when ``targets`` is None, otherwise the mean
        cross-entropy against ``targets`` (int64 [batch, seq]) as a scalar.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, seq], got shape {tuple(idx.shape)}")
        seq = idx.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {seq} tokens is longer than seq_len={self.cfg.seq_len}: "
                "crop the input or raise GPTConfig.seq_len"
            )
        # Positions go through the module (not its weight directly) so that hooks around it,
        # such as a ZeRO-3 unit's parameter gather, see the use.
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # [batch, seq, d_model]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # [batch, seq, vocab_size]
        if targets is None:
            return logits
        # a head whose logits are split over the vocabulary (tensor parallel) brings its loss
        parallel_loss = getattr(self.head, "cross_entropy", None)
        if parallel_loss is not None:
            return parallel_loss(logits, targets)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` (int64 [batch, seq]) by ``max_new_tokens`` sampled tokens.

        The context fed to the model is cropped to the last ``cfg.seq_len`` tokens.
        ``temperature`` divides the logits (0 picks the most likely token); ``top_k`` keeps only
        the k most likely tokens. Sampling draws from ``generator`` (default: global RNG).
        The caller chooses train/eval mode. Returns int64 [batch, seq + max_new_tokens].
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens}: set it to an int >= 0")
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: set it to >= 0 (0 means greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k}: set it to an int >= 1 or None")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.seq_len :])[:, -1, :]  # [batch, vocab_size]
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx

"""Tensor-parallel linear and embedding layers (Shoeybi et al. 2019, sec. 3).

The layers hold only this rank's shard of their weights. ``parallelize`` builds them from a
model's ``nn.Linear`` / ``nn.Embedding`` modules, keeping the same ``nn.Parameter`` objects
(their data replaced by the shard), so names, ties and optimizer references stay valid.

A ``Region`` is the tp group plus the sequence-parallel switch, shared by every layer of one
``parallelize`` call. Column-parallel layers that read the same input tensor (q, k and v; gate
and up) enter the region once: one collective in backward (or one all_gather in forward under
sequence parallelism) for all of them, as a fused qkv would cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.comm.groups import Group
from shardwise.parallel.tensor import mappings
from shardwise.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from shardwise.parallel.tensor.sequence import Regather, shard_saving_linear


class Region:
    """How activations enter and leave tp-sharded compute on one tp group."""

    def __init__(self, group: Group, sequence_parallel: bool) -> None:
        self.group = group
        self.sequence_parallel = sequence_parallel
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._whole: WeakIdKeyDictionary = WeakIdKeyDictionary()  # gathered by enter_whole

    def enter(self, x: torch.Tensor) -> tuple[torch.Tensor, Regather | None]:
        """Replicated (or, under SP, sequence-sharded) ``x`` -> full input of a column layer,
        and under SP with autograd on, the ``Regather`` its layers share in backward.

        Communicates: nothing in forward, all_reduce of the grad in backward; under sequence
        parallelism all_gather of dim 1 in forward, reduce_scatter (and the regather's
        all_gather) in backward.
        """
        if x in self._whole:  # already gathered for a module that needs the whole sequence
            return x, None
        key = (x._version, torch.is_grad_enabled())
        hit = self._entries.get(x)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        regather = None
        if self.sequence_parallel:
            entered = mappings.gather_sequence(x, self.group)
            if torch.is_grad_enabled() and self.group.size > 1:
                regather = Regather(self.group)
        else:
            entered = mappings.copy_to_tp(x, self.group)
        # kept while x lives (entered holds no reference to x, so the entry goes with x)
        self._entries[x] = (key, entered, regather)
        return entered, regather

    def enter_whole(self, x: torch.Tensor) -> torch.Tensor:
        """Under SP, the whole sequence of a sequence-sharded ``x`` for a module whose own code
        needs it (attention that reshapes by its input's length); the column layers inside take
        it as it is. Without SP, ``x``. Communicates: under SP all_gather of dim 1 in forward,
        reduce_scatter in backward (summing the column layers' input gradients over tp)."""
        if not self.sequence_parallel:
            return x
        whole = mappings.gather_sequence(x, self.group)
        self._whole[whole] = True
        return whole

    def is_whole(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a whole sequence gathered by ``enter_whole`` (or marked so)."""
        return x in self._whole

    def mark_whole(self, x: torch.Tensor) -> None:
        """Record that ``x`` spans the whole sequence: ``enter`` then takes it as it is."""
        self._whole[x] = True

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum partial outputs over tp: all_reduce, or reduce_scatter of dim 1 under SP."""
        if self.sequence_parallel:
            return mappings.scatter_sequence(partial, self.group)
        return mappings.reduce_from_tp(partial, self.group)


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T + b`` with W and b split along the output features.

    Forward output: ``[..., out_features / tp]`` (padded to a multiple of tp for a vocabulary),
    or the full ``[..., out_features]`` when ``gather_output`` (all_gather of the last dim; the
    padding cut off).
    """

    OUT_DIM = 0
    """The weight dim holding the output features (``nn.Linear`` stores ``[out, in]``)."""

    def __init__(
        self, linear: nn.Module, region: Region, full_out: int, gather_output: bool
    ) -> None:
        nn.Module.__init__(self)
        self.weight, self.bias = linear.weight, linear.bias  # type: ignore[assignment]
        self.in_features = self.weight.shape[1 - self.OUT_DIM]
        self.region = region
        self.full_out = full_out
        self.gather_output = gather_output
        self.out_features = full_out if gather_output else self.weight.shape[self.OUT_DIM]

    def linear_weight(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it, ``[out, in]`` (a layer storing it otherwise
        returns a view)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full, regather = self.region.enter(x)
        weight = self.linear_weight()
        if regather is None:
            y = F.linear(full, weight, self.bias)  # [..., chunk]
        else:  # keep x (this rank's sequence shard), not full, for the weight gradient
            y = shard_saving_linear(full, x, weight, self.bias, regather)
        if not self.gather_output:
            return y
        y = mappings.gather_last_dim(y, self.region.group)  # [..., chunk * tp]
        return y[..., : self.full_out] if y.shape[-1] != self.full_out else y

    def cross_entropy(
        self,
        local_logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """Mean cross-entropy of this layer's vocab-sharded output (see
        ``vocab_parallel_cross_entropy``); a model's loss calls it instead of gathering."""
        if self.gather_output:
            raise ValueError("this layer gathers its output; use F.cross_entropy on it")
        return vocab_parallel_cross_entropy(
            local_logits,
            targets,
            self.region.group,
            ignore_index,
            label_smoothing,
            vocab_size=self.full_out,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.region.group.size}, full_out={self.full_out}"


class RowParallelLinear(nn.Linear):
    """``y = x W^T + b`` with W split along the input features; x arrives split the same way.

    The partial products are summed over tp (all_reduce, or reduce_scatter of the sequence
    under SP); the bias, replicated, is added once after the sum.
    """

    IN_DIM = 1
    """The weight dim holding the input features (``nn.Linear`` stores ``[out, in]``)."""

    def __init__(self, linear: nn.Module, region: Region) -> None:
        nn.Module.__init__(self)
        self.weight, self.bias = linear.weight, linear.bias  # type: ignore[assignment]
        self.in_features = self.weight.shape[self.IN_DIM]
        self.out_features = self.weight.shape[1 - self.IN_DIM]
        self.region = region

    def linear_weight(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it, ``[out, in]``."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.region.leave(F.linear(x, self.linear_weight()))  # [..., out_features]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.region.group.size}"


class VocabParallelEmbedding(nn.Embedding):
    """Embedding whose rows (the vocabulary) are split over tp, padded to a multiple of tp.

    Ids outside this rank's rows look up nothing (zeros); the partial lookups are summed over tp
    (all_reduce, or reduce_scatter of the sequence under SP unless ``whole_output``).
    """

    def __init__(
        self, emb: nn.Embedding, region: Region, full_vocab: int, whole_output: bool = False
    ) -> None:
        nn.Module.__init__(self)
        if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise ValueError(
                "vocab_embedding supports plain nn.Embedding only "
                "(max_norm, sparse and scale_grad_by_freq are not split over tp)"
            )
        self.weight = emb.weight
        self.num_embeddings = full_vocab
        self.embedding_dim = emb.embedding_dim
        self.max_norm, self.norm_type = None, emb.norm_type
        self.scale_grad_by_freq, self.sparse = False, False
        self.region = region
        self.whole_output = whole_output
        chunk = self.weight.shape[0]
        self.start = region.group.rank * chunk
        self.real = max(0, min(chunk, full_vocab - self.start))
        pad = emb.padding_idx
        local_pad = None if pad is None else pad - self.start
        self.padding_idx = pad
        mine = local_pad is not None and 0 <= local_pad < self.real
        self._local_pad = local_pad if mine else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self._local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # [..., embedding_dim], partial
        if self.whole_output:
            return mappings.reduce_from_tp(out, self.region.group)
        return self.region.leave(out)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """This embedding as a tied output head: ``h [..., embedding_dim]`` (replicated, or
        sequence-sharded under SP) -> logits over this rank's rows ``[..., vocab / tp]`` (padded
        rows give logits a loss must ignore: ``cross_entropy`` does). Communicates as a
        column-parallel layer's input (backward all_reduce; under SP, all_gather forward)."""
        full, regather = self.region.enter(h)
        if regather is None:
            return F.linear(full, self.weight)
        return shard_saving_linear(full, h, self.weight, None, regather)

    def cross_entropy(
        self, local_logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """Mean cross-entropy of ``project``'s vocab-sharded logits (see
        ``vocab_parallel_cross_entropy``)."""
        return vocab_parallel_cross_entropy(
            local_logits, targets, self.region.group, ignore_index, vocab_size=self.num_embeddings
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.region.group.size}"

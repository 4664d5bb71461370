"""The vocabulary-parallel embedding: the table's rows split across tp."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax.tensor import functional as tpf
from parallax.tensor.sharding import make_shard, shard_tensor, unshard_tensor
from parallax.tensor.tp import TPLayer, TPLike, normal_, tp_param


class VocabParallelEmbedding(TPLayer):
    """Embedding table with its vocabulary rows split across tp.

    The vocabulary is zero-padded up to a multiple of tp. Each rank looks up the ids that fall
    in its rows, zeroes the rest, and the partial results are summed across tp (or
    reduce-scattered along ``sequence_dim`` with ``sequence_parallel``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        ctx: TPLike,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(ctx, sequence_parallel, sequence_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        info = make_shard(
            0,
            num_embeddings,
            self.tp_rank,
            self.tp_size,
            pad=True,
            what=f"VocabParallelEmbedding num_embeddings={num_embeddings}",
        )
        self.vocab_start, self.vocab_end = info.ranges()[0]
        self.weight = tp_param((info.local_size, embedding_dim), info, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        normal_(self.weight)
        valid = max(0, min(self.weight.shape[0], self.num_embeddings - self.vocab_start))
        with torch.no_grad():
            self.weight[valid:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)  # (..., h), partial: zero where outside
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return tpf.reduce_scatter_to_sp(out, self.group, self.sequence_dim)
        return tpf.reduce_from_tp(out, self.group)

    @classmethod
    def from_dense(cls, module: nn.Embedding, ctx: TPLike, **kwargs) -> VocabParallelEmbedding:
        """Shard an existing ``nn.Embedding`` exactly (same dtype and device)."""
        layer = cls(
            module.num_embeddings,
            module.embedding_dim,
            ctx=ctx,
            device=module.weight.device,
            dtype=module.weight.dtype,
            **kwargs,
        )
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(module.weight, layer.weight.tp_shard))
        return layer

    def to_dense(self) -> nn.Embedding:
        """Gather the full ``nn.Embedding`` (on every tp rank)."""
        dense = nn.Embedding(
            self.num_embeddings,
            self.embedding_dim,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        with torch.no_grad():
            dense.weight.copy_(unshard_tensor(self.weight, self.weight.tp_shard, self.group))
        return dense

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"rows=[{self.vocab_start}, {self.vocab_end})"
        )

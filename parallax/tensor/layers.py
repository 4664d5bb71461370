"""Tensor-parallel layers: column- and row-parallel linear (the vocab-parallel embedding is in
:mod:`parallax.tensor.embedding`).

Shards follow the usual convention: a column-parallel weight holds a contiguous block of output
rows, a row-parallel weight a contiguous block of input columns, an embedding a block of vocab
rows. Each sharded parameter carries ``param.tp_shard`` (see :mod:`parallax.tensor.sharding`).
Every layer takes ``ctx``: a :class:`~parallax.ParallelContext`, a bare tp process group, or
``None`` for a single process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax import comm
from parallax.comm import Group
from parallax.tensor import functional as tpf
from parallax.tensor.embedding import VocabParallelEmbedding
from parallax.tensor.fp8 import fp8_linear
from parallax.tensor.sharding import TPShard, make_shard, shard_tensor, unshard_tensor
from parallax.tensor.tp import TPLayer, TPLike, resolve_tp, tp_param, uniform_

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPLike",
    "VocabParallelEmbedding",
    "heads_per_rank",
    "weight_dtype",
    "resolve_tp",
    "sync_sequence_parallel_grads",
]


class _DenseLinear(TPLayer):
    """``from_dense`` / ``to_dense`` of the parallel linears: each parameter is split, or kept
    whole, as its ``tp_shard`` (or its absence) says. A frozen weight may be held quantized
    (``--quantize-base``: :func:`~parallax.tensor.quant.quantize_layer` puts a
    :class:`~parallax.tensor.quant.QuantizedWeight` in ``quantized`` in place of ``weight``).
    With ``fp8`` (``--fp8``: :func:`~parallax.tensor.fp8_apply.enable_fp8`) its GEMMs run in
    FP8 (:func:`~parallax.tensor.fp8.fp8_linear`)."""

    quantized: nn.Module | None
    fp8: bool = False

    @property
    def weight_shard(self) -> TPShard:
        """How the weight is split over tp, whether held as a parameter or quantized."""
        q = self.quantized
        return self.weight.tp_shard if q is None else q.tp_shard

    @property
    def weight_dtype(self) -> torch.dtype:
        """The weight's dtype (a quantized one's: the dtype it was quantized from)."""
        q = self.quantized
        return self.weight.dtype if q is None else q.dtype

    @property
    def local_shape(self) -> tuple[int, int]:
        q = self.quantized
        return tuple(self.weight.shape) if q is None else q.shape

    def _base_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` on this rank, without the bias: (..., in) -> (..., out)."""
        q = self.quantized
        if q is not None:
            return q.linear(x)
        return fp8_linear(x, self.weight) if self.fp8 else F.linear(x, self.weight)

    @classmethod
    def from_dense(cls, module: nn.Linear, ctx: TPLike, **kwargs):
        """Shard an existing ``nn.Linear`` exactly (same dtype and device)."""
        layer = cls(
            module.in_features,
            module.out_features,
            module.bias is not None,
            ctx=ctx,
            device=module.weight.device,
            dtype=module.weight.dtype,
            **kwargs,
        )
        with torch.no_grad():
            for name in ("weight", "bias"):
                mine, full = getattr(layer, name), getattr(module, name)
                if full is not None:
                    info = getattr(mine, "tp_shard", None)
                    mine.copy_(full if info is None else shard_tensor(full, info))
        return layer

    def to_dense(self) -> nn.Linear:
        """Gather the full ``nn.Linear`` (on every tp rank)."""
        dense = nn.Linear(
            self.in_features,
            self.out_features,
            self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        with torch.no_grad():
            for name in ("weight", "bias"):
                mine = getattr(self, name)
                if mine is not None:
                    info = getattr(mine, "tp_shard", None)
                    full = mine if info is None else unshard_tensor(mine, info, self.group)
                    getattr(dense, name).copy_(full)
        return dense


class ColumnParallelLinear(_DenseLinear):
    """``y = x A^T + b`` with ``A``'s output rows split across tp.

    The input is replicated on every tp rank; the output is this rank's slice of the features
    (``gather_output=False``, ready for a :class:`RowParallelLinear`) or the full output.
    ``partitions > 1`` marks a fused weight (QKV: 3, gate/up: 2) whose equal blocks are each
    split, so every rank gets its own heads of each. ``pad=True`` pads ``out_features`` up to a
    multiple of tp (zero rows; pass ``vocab_size=out_features`` to the loss to mask them).
    With ``sequence_parallel`` the input arrives split along ``sequence_dim`` and is gathered.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        *,
        ctx: TPLike,
        partitions: int = 1,
        pad: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(ctx, sequence_parallel, sequence_dim)
        self.in_features, self.out_features = in_features, out_features
        self.quantized = None
        self.gather_output = gather_output
        if gather_output and partitions > 1:
            raise ValueError("gather_output=True is not supported for fused (partitions>1) weights")
        info = make_shard(
            0,
            out_features,
            self.tp_rank,
            self.tp_size,
            partitions,
            pad,
            what=f"ColumnParallelLinear out_features={out_features}",
        )
        self.weight = tp_param((info.local_size, in_features), info, device, dtype)
        self.bias = tp_param((info.local_size,), info, device, dtype) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        uniform_(self.weight, self.in_features)
        if self.bias is not None:
            uniform_(self.bias, self.in_features)
        self._zero_padding()

    def _zero_padding(self) -> None:
        info: TPShard = self.weight.tp_shard
        start, _ = info.ranges()[0]
        valid = max(0, min(info.local_size, info.full_size - start))
        with torch.no_grad():
            for p in (self.weight, self.bias):
                if p is not None and valid < info.local_size:
                    p[valid:].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = tpf.gather_from_sp(x, self.group, self.sequence_dim)
        else:
            x = tpf.copy_to_tp(x, self.group)
        y = self._product(x)  # (..., out/tp)
        if self.gather_output:
            y = tpf.gather_from_tp(y, self.group, dim=-1)
            if self.weight_shard.padded_size != self.out_features:
                y = y[..., : self.out_features]
        return y

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product (a LoRA layer adds its adapter's)."""
        if self.quantized is None and not self.fp8:
            return F.linear(x, self.weight, self.bias)
        y = self._base_product(x)  # (..., out/tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_size}, local_out={self.local_shape[0]}, "
            f"gather_output={self.gather_output}"
        )


class RowParallelLinear(_DenseLinear):
    """``y = x A^T + b`` with ``A``'s input columns split across tp.

    The input is this rank's slice of the features (``input_is_parallel=True``, as produced by
    a :class:`ColumnParallelLinear`) or the full input, which is then split. Partial products are
    summed across tp (or reduce-scattered along ``sequence_dim`` with ``sequence_parallel``);
    the bias is replicated and added once, after the sum; it starts at zero, the same on every
    tp rank whatever its random state.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        *,
        ctx: TPLike,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(ctx, sequence_parallel, sequence_dim)
        self.in_features, self.out_features = in_features, out_features
        self.quantized = None
        self.input_is_parallel = input_is_parallel
        info = make_shard(
            1,
            in_features,
            self.tp_rank,
            self.tp_size,
            what=f"RowParallelLinear in_features={in_features}",
        )
        self.weight = tp_param((out_features, info.local_size), info, device, dtype)
        self.bias = tp_param((out_features,), None, device, dtype) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # sees only this rank's tokens: sum grads over tp
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight shards from this rank's generator; the bias, replicated over tp, at zero (as
        Megatron-LM does): a random draw would differ between tp ranks whose generators differ,
        and the ranks would then train different copies of one logical bias."""
        uniform_(self.weight, self.in_features)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = tpf.scatter_to_tp(x, self.group, dim=-1)
        y = self._product(x)  # (..., out) partial sum over this rank's inputs
        if self.sequence_parallel:
            y = tpf.reduce_scatter_to_sp(y, self.group, self.sequence_dim)
        else:
            y = tpf.reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, before the bias (a LoRA layer adds its adapter's)."""
        return self._base_product(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_size}, local_in={self.local_shape[1]}, "
            f"input_is_parallel={self.input_is_parallel}"
        )


def weight_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype of a linear layer's weight: a parallel one's (held quantized or not) or a
    plain ``nn.Linear``'s (a model densified for torch's own parallelism)."""
    own = getattr(linear, "weight_dtype", None)
    return own if own is not None else linear.weight.dtype


def heads_per_rank(num_heads: int, tp_size: int, what: str = "attention") -> int:
    """Attention heads each tp rank holds; a ``ValueError`` when they do not divide evenly."""
    if num_heads % tp_size != 0:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"{what}: {num_heads} heads cannot be split over tp={tp_size}; "
            f"tp must divide the head count (one of {divisors})"
        )
    return num_heads // tp_size


def sync_sequence_parallel_grads(module: nn.Module, group: Group) -> None:
    """Sum over tp the gradients of replicated parameters marked ``sequence_parallel``, for
    training without :class:`~parallax.optim.ZeroOptimizer` (a plain torch optimizer).

    Under sequence parallelism such a parameter (a row-parallel bias, a norm weight) sees only
    this rank's part of the sequence, so its gradient is partial until summed. Call it after the
    backward pass, before clipping and the optimizer step. A ZeroOptimizer makes that sum itself
    as part of its reduction, so for parameters it owns this raises ``ValueError`` instead of
    summing a second time (the verdict is the same on every tp rank: ZeroOptimizer is built
    over the same sequence-parallel parameters on all of them).
    """
    marked = [
        (n, p) for n, p in module.named_parameters() if getattr(p, "sequence_parallel", False)
    ]
    owned = [n for n, p in marked if getattr(p, "_zero_owner", None) is not None]
    if owned:
        raise ValueError(
            f"sync_sequence_parallel_grads: {len(owned)} sequence-parallel parameters (e.g. "
            f"{owned[:3]}) belong to a ZeroOptimizer, which sums their gradients over tp itself; "
            "do not call sync_sequence_parallel_grads with it (that would double them)"
        )
    for _, p in marked:
        if p.grad is not None:
            comm.all_reduce(p.grad, group)

"""LoRA adapters on the tensor-parallel linears: ``y = base(x) + (alpha / r) B A dropout(x)``.

The sharding scheme shards one factor like the base weight and replicates the other, as PEFT's
tensor-parallel layers do (Megatron-Bridge shards both):

- column-parallel base (W's output rows split): A ``(r, in)`` replicated, B ``(out/tp, r)`` split
  like W's rows (``tp_shard`` of the base weight: padding and fused blocks included);
- row-parallel base (W's input columns split): A ``(r, in/tp)`` split like W's columns, B
  ``(out, r)`` replicated;
- replicated base (:class:`~parallax.tensor.replicated.ReplicatedLinear`: a multi-query key or
  value projection): A and B whole on every rank; the layer's output sums its gradient over tp,
  so theirs are whole already.

Why this one: the adapter then needs no collective of its own. A column adapter reads the input
the base layer reads (after its copy or sequence gather) and adds ``B_rank A x`` to this rank's
output features; a row adapter adds the partial ``B (A_rank x_rank)`` to the base's partial sum,
which the base's own all-reduce (or reduce-scatter) adds up to ``B A x``. The input gradient
through A joins the base's input-gradient collective the same way. Sharding both factors costs
a gather of the rank-r activation each way and needs ``r`` divisible by tp. What this scheme
costs instead: the replicated factor's gradient on each rank is partial (the column A sees only
this rank's output features, the row B only this rank's input features). Such a parameter
carries ``sequence_parallel = True``, the flag of parameters whose gradient must be summed over
tp: :class:`~parallax.optim.ZeroOptimizer` sums it once per step (plain loops call
:func:`~parallax.tensor.sync_sequence_parallel_grads`). It starts identical on every tp rank by
construction (drawn from a generator seeded by the run seed and its name, or zero) and then gets
identical updates, so it stays one logical tensor.

A fused column weight (``partitions = k``: q/k/v, gate/up) gets either one adapter (``groups=1``:
the checkpoint stores the module fused, timm's ``qkv``) with B ``(k * out_k, r)``, or ``k``
adapters (``groups=k``: the checkpoint stores k modules, Llama's q/k/v_proj), stacked: A
``(k r, in)`` and B ``(k out_k, r)`` whose row blocks follow the base weight's partition order
(each rank holds its own heads of every block), with adapter j mapping A_j to block j only.

Adapters train in their own dtype (fp32 by default: ZeRO keeps them as their own fp32 masters
while the frozen base stays bf16); the forward casts them to the input's dtype, so compute runs
in the model's dtype. Dropout needs the same mask on every tp rank for a column (or replicated)
adapter; the ranks' random states are not kept in step, so dropout > 0 is refused there at
tp > 1 (a row adapter's input is split over tp: independent masks are exactly a dropout of the
whole input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallax.seeds import param_seed
from parallax.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.replicated import ReplicatedLinear
from parallax.tensor.sharding import TPShard, shard_tensor

LORA_PARAMS = ("lora_A", "lora_B")


class _LoRAMixin:
    """Adapter state and the pieces both kinds share (set up by :func:`add_adapter`)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_names: tuple[str, ...]  # one logical name per adapter (seeds, PEFT export)
    lora_groups: int  # len(lora_names), kept apart: see add_adapter
    lora_rank: int
    lora_alpha: float
    lora_dropout: float

    @property
    def lora_scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout == 0.0:
            return x
        return F.dropout(x, self.lora_dropout, self.training)

    def _up(self, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``B h`` with adapter j's rows fed by h's j-th rank-r group: (..., g r) -> (..., out)."""
        g = self.lora_groups
        if g == 1:
            return F.linear(h, b)
        h = h.unflatten(-1, (g, self.lora_rank))  # (..., g, r)
        out = torch.einsum("...gr,gor->...go", h, b.view(g, -1, self.lora_rank))
        return out.flatten(-2)  # (..., g * out_g) in partition order

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's product on this rank plus the adapter's (each layer's ``forward``
        does the rest: the collectives and, for a row-parallel layer, the bias after them)."""
        return super()._product(x) + self._adapter(x)  # type: ignore[misc]

    def _adapter(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lora_A.to(x.dtype)
        b = (self.lora_B * self.lora_scaling).to(x.dtype)  # scale the small factor, not y
        return self._up(F.linear(self._drop(x), a), b)

    @torch.no_grad()
    def lora_delta(self) -> torch.Tensor:
        """``(alpha / r) B A`` for this rank's slice of the weight, in fp32 (the merge's term)."""
        a, b = self.lora_A.float(), self.lora_B.float()
        g, r = self.lora_groups, self.lora_rank
        if g == 1:
            delta = b @ a
        else:  # block j of the output rows from adapter j alone
            delta = torch.bmm(b.view(g, -1, r), a.view(g, r, -1)).flatten(0, 1)
        return delta.mul_(self.lora_scaling)  # (weight rows, weight cols) on this rank

    @torch.no_grad()
    def reset_adapter(self, seed: int) -> None:
        """Layout-free init, PEFT's ``init_lora_weights="gaussian"``: each adapter's full A
        ``(r, in)`` from N(0, 1/r) drawn by a generator seeded with ``(seed, name.lora_A.weight)``,
        then this rank's slice; B zero. No rank's own random state is read."""
        b = self.lora_B
        b.zero_()
        if b.is_meta:
            return
        a = self.lora_A
        full_in = self.in_features
        parts = []
        for name in self.lora_names:
            gen = torch.Generator(device=a.device).manual_seed(
                param_seed(seed, f"{name}.lora_A.weight")
            )
            part = torch.empty(self.lora_rank, full_in, device=a.device)
            parts.append(part.normal_(0.0, 1.0 / self.lora_rank, generator=gen))
        full = torch.cat(parts) if len(parts) > 1 else parts[0]  # (g r, in) logical
        info: TPShard | None = getattr(a, "tp_shard", None)
        a.copy_(full if info is None else shard_tensor(full, info))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"  # type: ignore[misc]

    def lora_extra_repr(self) -> str:
        return (
            f"lora: r={self.lora_rank}, alpha={self.lora_alpha}, dropout={self.lora_dropout}, "
            f"adapters={len(self.lora_names)}"
        )


class LoRAColumnParallelLinear(_LoRAMixin, ColumnParallelLinear):
    """A :class:`ColumnParallelLinear` with an adapter (A replicated, B split like the weight).
    Made from an existing layer by :func:`add_adapter`; its base parameters keep their names."""


class LoRARowParallelLinear(_LoRAMixin, RowParallelLinear):
    """A :class:`RowParallelLinear` with an adapter (A split like the weight, B replicated).
    Made from an existing layer by :func:`add_adapter`; its base parameters keep their names."""


class LoRAReplicatedLinear(_LoRAMixin, ReplicatedLinear):
    """A :class:`ReplicatedLinear` with an adapter (A and B whole on every rank)."""


_KINDS = {
    ColumnParallelLinear: LoRAColumnParallelLinear,
    RowParallelLinear: LoRARowParallelLinear,
    ReplicatedLinear: LoRAReplicatedLinear,
}
_BASES = {v: k for k, v in _KINDS.items()}


def is_lora_layer(module: nn.Module) -> bool:
    return isinstance(module, _LoRAMixin)


def _adapter_param(shape, info: TPShard | None, partial: bool, like: torch.Tensor, dtype):
    p = nn.Parameter(torch.zeros(shape, device=like.device, dtype=dtype))
    if info is not None:
        p.tp_shard = info
    if partial:
        p.sequence_parallel = True  # gradient partial over tp: summed by the optimizer
    return p


def add_adapter(
    layer: ColumnParallelLinear | RowParallelLinear | ReplicatedLinear,
    names: tuple[str, ...],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    *,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
) -> _LoRAMixin:
    """Turn ``layer`` into its LoRA kind in place (same object, same base parameters) with one
    adapter per name in ``names`` (1, or the fused weight's ``partitions``), initialised
    layout-free from ``seed`` (``None``: left at zero, e.g. before loading an adapter)."""
    base = type(layer)
    if base not in _KINDS:
        raise TypeError(
            "LoRA wraps ColumnParallelLinear, RowParallelLinear and ReplicatedLinear exactly, "
            f"got {base.__name__}"
        )
    rank = check_rank(rank)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
    if dropout > 0 and layer.tp_size > 1 and base is not RowParallelLinear:
        raise ValueError(
            f"LoRA dropout {dropout} at tp={layer.tp_size}: a column-parallel or replicated "
            "adapter needs the same dropout mask on every tp rank, whose random states "
            "parallax does not keep in step; use dropout 0 (OpenVLA's recipe) or tp=1"
        )
    info: TPShard | None = getattr(layer.weight, "tp_shard", None)  # None: replicated
    g, partitions = len(names), 1 if info is None else info.partitions
    if g not in (1, partitions) or (base is not ColumnParallelLinear and g != 1):
        raise ValueError(
            f"a layer with {partitions} fused blocks takes 1 or {partitions} adapters, "
            f"got {g} ({list(names)})"
        )
    w = layer.weight
    if info is None:  # whole gradients: the layer's output sums them over tp
        a = _adapter_param((rank, layer.in_features), None, False, w, dtype)
        b = _adapter_param((layer.out_features, rank), None, False, w, dtype)
    elif base is ColumnParallelLinear:
        a = _adapter_param((g * rank, layer.in_features), None, True, w, dtype)
        b = _adapter_param((info.local_size, rank), info, False, w, dtype)
    else:
        a = _adapter_param((rank, info.local_size), info, False, w, dtype)
        b = _adapter_param((layer.out_features, rank), None, True, w, dtype)
    layer.__class__ = _KINDS[base]
    layer.lora_A, layer.lora_B = a, b
    # The forward reads only the count: torch.compile guards on every attribute a forward
    # touches, and a guard on the (per-layer) names would recompile each layer anew.
    layer.lora_names, layer.lora_groups, layer.lora_rank = tuple(names), g, rank
    layer.lora_alpha, layer.lora_dropout = float(alpha), float(dropout)
    if seed is not None:
        layer.reset_adapter(seed)
    return layer


@torch.no_grad()
def remove_adapter(layer: _LoRAMixin, merge: bool) -> nn.Module:
    """Back to the plain layer in place; with ``merge`` first ``W += (alpha/r) B A`` on this
    rank's slice, summed in fp32 and rounded once to W's dtype (a bf16 sum of bf16 products is
    not reproducible across kernels)."""
    if merge:
        w = layer.weight
        w.copy_((w.float() + layer.lora_delta()).to(w.dtype))
    for name in (
        *LORA_PARAMS,
        "lora_names",
        "lora_groups",
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
    ):
        delattr(layer, name)
    layer.__class__ = _BASES[type(layer)]
    return layer


def adapter_numel(layer: _LoRAMixin) -> int:
    """Logical adapter parameters of ``layer`` (A and B at full size)."""
    g, r = layer.lora_groups, layer.lora_rank
    return g * r * layer.in_features + r * layer.out_features


def check_rank(rank: int) -> int:
    """``rank`` as a positive int (config files may give floats such as 32.0)."""
    if isinstance(rank, float) and rank.is_integer():
        rank = int(rank)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    return rank

"""The true global gradient norm over dp, tp and pp, from reduced and sharded gradients.

After the reduce-scatter, each element of each logical gradient lives in exactly one place per
tp rank: in the dp shard of one rank. So the global norm is one sum over the world group of what
each rank owns, counting tp-sharded parameters on every tp rank (they hold different pieces)
and tp-replicated ones on tp rank 0 only (every tp rank holds the same values). Pipeline
stages hold different parameters, so they simply add up. A parameter that two stages share
(tied embeddings on the first and last stage) would be counted twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from parallax import comm
from parallax.context import ParallelContext
from parallax.optim.zero.buffers.packing import Piece
from parallax.optim.zero.torch_contract import grad_scale


def global_grad_norm(
    groups: Iterable[Sequence[torch.Tensor]],
    ctx: ParallelContext,
    norm_type: float = 2.0,
    device: torch.device | None = None,
    host_part: float = 0.0,
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of all ranks, as a 0-d fp32 tensor everywhere.

    ``groups`` yields lists of this rank's counted (reduced) gradient pieces; each list is read
    before the next is asked for (they may be views of one reused buffer), with one
    multi-tensor norm. ``host_part``: what this rank's offloaded gradients add (the sum of
    their ``norm_type`` powers, or their largest element for the inf-norm). Every rank must
    call this.
    """
    norm_type = float(norm_type)
    device = device or ctx.device
    local = torch.full((), host_part, dtype=torch.float64, device=device)
    for group in groups:
        if not group:
            continue
        norms = _fp32_norms([g.detach() for g in group], norm_type)  # per piece
        if math.isinf(norm_type):
            local = torch.maximum(local, torch.stack(norms).max().double())
        else:  # the pieces' powers summed in fp64
            local += (torch.stack(norms).double() ** norm_type).sum()
    if math.isinf(norm_type):
        comm.all_reduce(local, ctx.world_group, op="max")
        return local.float()
    comm.all_reduce(local, ctx.world_group, op="sum")
    return (local ** (1.0 / norm_type)).float()


def _fp32_norms(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's norm, accumulated and returned in fp32 whatever its dtype (16-bit
    gradients are read as they are: no fp32 copy)."""
    if all(t.dtype == torch.float32 for t in tensors):
        return torch._foreach_norm(tensors, norm_type)
    try:
        return torch._foreach_norm(tensors, norm_type, dtype=torch.float32)
    except TypeError:  # a torch without the dtype argument
        return [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in tensors]


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def counted_pieces(
    pieces: Sequence[Piece], params: Sequence[torch.Tensor], tp_rank: int
) -> list[bool]:
    """Which of this rank's pieces count in the global norm: those of tp-sharded parameters on
    every tp rank, the tp-replicated ones on tp rank 0 only (every tp rank holds the same)."""
    return [
        tp_rank == 0 or getattr(params[pc.param], "tp_shard", None) is not None for pc in pieces
    ]


class StepScale:
    """What the reduced gradients of this step still owe: the dp average and the clip
    coefficients. With ``fold`` (a fused optimizer that takes a ``grad_scale``) the reduction
    leaves dp sums and both are divided out inside the optimizer's kernel, no pass of their own;
    otherwise the reduction averages and a clip scales the gradients in place, or, for staged
    buckets, when ``step()`` makes their fp32 gradients (``coefs``)."""

    def __init__(self, fold: bool, dp: int, device: torch.device) -> None:
        self.fold, self.dp, self.device = fold, dp, device
        self.reset()

    def reset(self) -> None:
        """A new step: nothing clipped yet."""
        self.coefs: list[torch.Tensor] = []  # clip coefficients, for staged buckets
        self.unscale: torch.Tensor | None = None  # clip coefficients folded into the step

    def true_norm(self, total: torch.Tensor) -> torch.Tensor:
        """The norm of the averaged, clipped gradients, from that of what the buffers hold."""
        if self.fold:  # the reduced gradients hold dp sums (and no clip coefficient yet)
            if self.dp > 1:
                total = total / self.dp
            if self.unscale is not None:
                total = total * self.unscale
        return total

    def clip(self, coef: torch.Tensor, outs: Iterable[torch.Tensor | None], staged: bool) -> None:
        """Scale by ``coef``: folded, or the reduced gradients ``outs`` now (and the ``staged``
        buckets' when they are made)."""
        if self.fold:  # applied by the optimizer's kernel in step()
            self.unscale = coef if self.unscale is None else self.unscale * coef
            return
        for out in outs:
            if out is not None:
                out.mul_(coef)
        if staged:
            self.coefs.append(coef)

    def folded(self, inner: torch.optim.Optimizer) -> AbstractContextManager:
        """Around the wrapped optimizer's step: let its kernel divide the reduced gradients by
        ``dp / clip coefficients`` where it folds them."""
        if not self.fold or (self.dp == 1 and self.unscale is None):
            return nullcontext()
        if self.unscale is None:
            return grad_scale(inner, torch.full((), float(self.dp), device=self.device))
        return grad_scale(inner, self.dp / self.unscale)

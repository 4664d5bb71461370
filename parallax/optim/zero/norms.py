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

import torch

from parallax import comm
from parallax.context import ParallelContext


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


class NormMethods:
    """ZeroOptimizer's ``grad_norm`` and ``clip_grad_norm_``, from its reduced gradients (or, with
    the optimizer offloaded, from each bucket's share taken on the host)."""

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over dp, tp and pp (every rank must call it); reduces the
        gradients first if ``step()`` has not yet."""
        self._reduce()
        host = self.host.local_part(norm_type) if self.host is not None else 0.0
        replicated = [
            getattr(self.params[pc.param], "tp_shard", None) is None for pc in self.flat.pieces
        ]
        skip = self.host.buckets if self.host is not None else ()  # offloaded: in ``host``
        counted = (  # tp-replicated pieces count on tp rank 0 only
            [g for k, g in group if not replicated[k] or self.ctx.tp_rank == 0]
            # staged buckets: their 16-bit gradients, the norm taken in fp32
            for group in self.flat.reduced_grads_by_bucket(self._coefs, True, skip)
        )
        total = global_grad_norm(counted, self.ctx, norm_type, self.device, host)
        if self._fold:  # the reduced gradients hold dp sums (and no clip coefficient yet)
            if self.ctx.dp_size > 1:
                total = total / self.ctx.dp_size
            if self._unscale is not None:
                total = total * self._unscale
        return total

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process; returns the norm before.
        (Staged buckets are scaled when ``step()`` makes their fp32 gradients.)"""
        total = self.grad_norm(norm_type)
        coef = clip_coefficient(total, max_norm)
        if self.host is not None:
            self.host.clip(coef)  # (no folding when offloaded: the others are scaled below)
        if self._fold:  # applied by the optimizer's kernel in step()
            self._unscale = coef if self._unscale is None else self._unscale * coef
            return total
        for out in self.flat.grad_outs:
            if out is not None:
                out.mul_(coef)
        if self.staged:
            self._coefs.append(coef)
        return total

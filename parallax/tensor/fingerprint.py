"""A layout-free fingerprint of a model's frozen weights: is this the base the adapters grew on?

A LoRA checkpoint holds only what trains; resuming it onto another base would silently train
something else. Hashing the bytes would depend on the layout (which rank holds which slice)
and cost a gather. Instead each parameter gets three float64 sums over its logical tensor
``X`` (viewed as ``(rows, cols)``: dim 0 by the rest): ``sum X``, ``u^T X v`` and
``sum X**2``, with fixed position weights ``u_i``, ``v_j`` in [0.5, 1.5] of the global
row and column indices. Sums over elements split over any tp slicing, so each rank adds up
its own slice (one read of its weights, in row chunks) and tp peers sum three numbers: the same
values, up to float64 rounding, at every tp, pp and dp. The weighted sum sees moved or changed
elements that plain sums miss; it is no cryptographic hash (nothing adversarial is expected).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from parallax import comm
from parallax.tensor.quant import quantized_weights
from parallax.tensor.sharding import TPShard


def _logical(shape: torch.Size, info: TPShard | None) -> tuple[int, ...]:
    """The whole tensor's shape from this rank's ``shape`` and its split."""
    return tuple(shape) if info is None else info.full_shape(tuple(shape))


Fingerprint = dict[str, list]  # name -> [logical shape, sum, weighted sum, sum of squares]
_CHUNK = 4096  # rows converted to float64 at a time


def _weights(index: torch.Tensor, phase: float) -> torch.Tensor:
    return 1.0 + 0.5 * torch.sin(index.double() * 0.7548776662 + phase)  # in [0.5, 1.5]


def _local_sums(p: torch.Tensor, info: TPShard | None) -> torch.Tensor:
    """(sum, weighted sum, sum of squares) of this rank's slice, at its global positions."""
    x = p.detach()
    x = x.reshape(1, -1) if x.dim() == 0 else x.reshape(x.shape[0], -1)  # (rows, cols) local
    dev = x.device
    rows = torch.arange(x.shape[0], device=dev)
    cols = torch.arange(x.shape[1], device=dev)
    if info is not None and info.dim % p.dim() == 0:
        rows = torch.cat([torch.arange(a, b, device=dev) for a, b in info.ranges()])
    elif info is not None:  # column slices of a 2-D weight
        (a, b), *_ = info.ranges()
        cols = torch.arange(a, b, device=dev)
    u, v = _weights(rows, 0.1), _weights(cols, 0.7)
    out = torch.zeros(3, dtype=torch.float64, device=dev)
    for start in range(0, x.shape[0], _CHUNK):
        chunk = x[start : start + _CHUNK].double()  # (chunk, cols)
        out[0] += chunk.sum()
        out[1] += (u[start : start + _CHUNK] * (chunk @ v)).sum()
        out[2] += chunk.pow(2).sum()
    return out


@torch.no_grad()
def base_fingerprint(model: nn.Module, ctx=None, names: Iterable[str] | None = None) -> Fingerprint:
    """The fingerprint of ``names`` (default: every frozen parameter, and every weight held
    quantized, as its dequantized values) over all stages; collective (tp sums, one object
    gather over the world); the same dict on every rank."""
    params = {n: (p, getattr(p, "tp_shard", None)) for n, p in model.named_parameters()}
    quantized = {n: q for n, q in quantized_weights(model)}
    if names is None:
        names = [n for n, (p, _) in params.items() if not p.requires_grad] + list(quantized)
    chosen = sorted(names)
    tp_group = None if ctx is None else ctx.tp_group
    tp_rank = 0 if ctx is None else ctx.tp_rank
    rows, shapes = [], []
    for name in chosen:
        if name in quantized:
            q = quantized[name]
            p, info = q.dequantize(torch.float32), q.tp_shard
        else:
            p, info = params[name]
        shapes.append(list(_logical(p.shape, info)))
        if info is None and tp_rank != 0:  # replicated: counted once, on tp rank 0
            rows.append(torch.zeros(3, dtype=torch.float64, device=p.device))
        else:
            rows.append(_local_sums(p, info))
    device = rows[0].device if rows else torch.device("cpu")
    sums = torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64, device=device)
    comm.all_reduce(sums, tp_group)  # (params, 3): one collective for all of them
    mine: Fingerprint = {
        name: [shape, *row] for name, shape, row in zip(chosen, shapes, sums.tolist())
    }
    if ctx is None or ctx.world_size == 1:
        return mine
    gathered = comm.all_gather_object((ctx.dp_rank, ctx.tp_rank, mine), ctx.world_group)
    out: Fingerprint = {}
    for dp, tp, fp in gathered:
        if dp == 0 and tp == 0:
            out.update(fp)
    return dict(sorted(out.items()))


def fingerprint_mismatches(a: Fingerprint, b: Fingerprint, rtol: float = 1e-9) -> list[str]:
    """Names whose presence, shape or sums differ (sums within ``rtol`` of their bound
    ``sqrt(numel * sum of squares)``, the float64 rounding of another summation order)."""
    bad = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        (sa, *xa), (sb, *xb) = a[name], b[name]
        if list(sa) != list(sb):
            bad.append(name)
            continue
        bound = math.sqrt(math.prod(sa) * max(xa[2], xb[2], 1e-300))
        if any(abs(p - q) > rtol * bound for p, q in zip(xa, xb)):
            bad.append(name)
    return bad

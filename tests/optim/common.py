"""A tiny model with every kind of parameter ZeRO must handle, its data, and a reference run.

``Net`` has a column-parallel layer (tp-sharded weight and bias), a row-parallel layer (sharded
weight, replicated bias that is sequence-parallel with ``sp``), a norm and a head (replicated),
a frozen layer, a parameter that is never used, and a "tower" used only by the batch rows that
ask for it (so on some steps no rank, or only some dp ranks, give it a gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import parallax
from parallax.optim import ZeroOptimizer
from parallax.tensor import ColumnParallelLinear, RowParallelLinear, full_tensor, gather_from_tp

SEED = 7
H, S, GLOBAL_BATCH = 8, 4, 8  # hidden, sequence, rows per micro-batch over all dp ranks


class Net(nn.Module):
    def __init__(self, ctx=None, sp: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.ctx, self.sp = ctx, sp
        kw = dict(ctx=ctx, sequence_parallel=sp, dtype=dtype)
        self.unused = nn.Parameter(torch.ones(5, dtype=dtype))  # first: its bucket goes last
        self.frozen = nn.Linear(H, H, dtype=dtype).requires_grad_(False)
        self.tower = nn.Linear(H, H, dtype=dtype)
        self.fc1 = ColumnParallelLinear(H, 2 * H, **kw)
        self.fc2 = RowParallelLinear(2 * H, H, **kw)
        self.norm = nn.LayerNorm(H, dtype=dtype)
        self.head = nn.Linear(H, 4, dtype=dtype)
        if sp:  # the tower sees only this rank's part of the sequence: partial gradients
            for p in self.tower.parameters():
                p.sequence_parallel = True

    def forward(self, x: torch.Tensor, use_tower: torch.Tensor) -> torch.Tensor:
        tp = 1 if self.ctx is None else self.ctx.tp_size
        if self.sp and tp > 1:
            x = x.chunk(tp, dim=1)[self.ctx.tp_rank]  # (b, s/tp, h)
        h = self.frozen(x)
        if use_tower.any():
            h = h + use_tower[:, None, None].to(h.dtype) * self.tower(x)
        h = self.fc2(F.gelu(self.fc1(h)))  # (b, s/tp, h) with sp, else (b, s, h)
        if self.sp and tp > 1:
            h = gather_from_tp(h, self.ctx.tp_group, dim=1)  # (b, s, h)
        return self.head(self.norm(h))


def build(ctx=None, sp: bool = False, dtype: torch.dtype | None = None) -> Net:
    model = Net(ctx, sp, dtype)
    parallax.init_parameters(model, SEED)  # the same logical weights at every layout
    return model


def groups(model: nn.Module, named: bool = True) -> list[dict]:
    """Weight decay on matrices only, as for norms and biases in practice."""
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    if not named:
        decay, no_decay = [p for _, p in decay], [p for _, p in no_decay]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, micro: int, dtype=torch.float32):
    """The global micro-batch: inputs, targets, and which rows use the tower (row 0 on odd
    steps, none on even ones: only dp rank 0 ever uses it)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_BATCH, S, H, generator=g)
    y = torch.randn(GLOBAL_BATCH, S, 4, generator=g)
    use = torch.zeros(GLOBAL_BATCH, dtype=torch.bool)
    use[0] = step % 2 == 1
    return x.to(dtype), y.to(dtype), use


def local_rows(t: torch.Tensor, ctx) -> torch.Tensor:
    b = t.shape[0] // ctx.dp_size
    return t[ctx.dp_rank * b : (ctx.dp_rank + 1) * b]


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    # fused kernels take ZeRO's dp average and clip coefficient as their grad_scale
    "adamw-fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    # no momentum: torch's fused SGD fails when a parameter first gets a gradient on a later
    # step than the others (the sometimes-used tower), with or without ZeRO
    "sgd-fused": (torch.optim.SGD, dict(lr=0.1, weight_decay=0.1, fused=True)),
}


def train_reference(
    name: str, steps: int, accum: int, clip: float | None, start: int = 0, model=None, opt=None
):
    """Plain torch on one process, the whole global batch. Returns (model, opt, norms)."""
    cls, kwargs = OPTIMIZERS[name]
    model = model or build()
    opt = opt or cls(groups(model, named=False), **kwargs)
    norms = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y, use = batch(step, micro)
            (F.mse_loss(model(x, use), y) / accum).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return model, opt, norms


def make_zero(ctx, name: str, sp: bool = False, dtype=None, **kw) -> tuple[Net, ZeroOptimizer]:
    cls, kwargs = OPTIMIZERS[name]
    model = build(ctx, sp, dtype)
    kw.setdefault("bucket_numel", 100)  # several buckets even for this tiny model
    kw.setdefault("param_order", model.parameters())
    return model, ZeroOptimizer(groups(model), cls, ctx, **kw, **kwargs)


def train_zero(
    model, opt, ctx, steps: int, accum: int, clip: float | None, start: int = 0, dtype=torch.float32
):
    norms = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y, use = (local_rows(t, ctx) for t in batch(step, micro, dtype))
            (F.mse_loss(model(x, use), y) / accum).backward()
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
    return norms


def logical_weights(model: nn.Module, ctx) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p, ctx.tp_group).float() for n, p in model.named_parameters()}

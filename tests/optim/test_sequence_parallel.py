"""Sequence parallelism through ZeRO (tp=2 x dp=2) against one process, and one owner of the
tp sum of sequence-parallel gradients: ZeroOptimizer, never also sync_sequence_parallel_grads."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from parallax import comm
from parallax.optim import ZeroOptimizer
from parallax.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    full_tensor,
    gather_from_tp,
    sync_sequence_parallel_grads,
    unshard_tensor,
)
from parallax.testing import context, run_ranks

H, F_, S, ROWS, STEPS = 8, 16, 4, 8, 3
TOL = dict(rtol=1e-5, atol=1e-6)


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, F_), nn.Linear(F_, H)
        self.head = nn.Linear(H, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.fc2(F.gelu(self.fc1(self.norm(x)))))


class SequenceParallel(nn.Module):
    """``Dense`` with the sequence split over tp outside the column/row pair: the norm, the
    row-parallel bias and the head see this rank's tokens only (partial gradients)."""

    def __init__(self, dense: Dense, ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, 3)
        self.norm.load_state_dict(dense.norm.state_dict())
        self.head.load_state_dict(dense.head.state_dict())
        for p in [*self.norm.parameters(), *self.head.parameters()]:
            p.sequence_parallel = True
        self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, ctx, sequence_parallel=True)
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, ctx, sequence_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.chunk(self.ctx.tp_size, dim=1)[self.ctx.tp_rank]  # (b, s/tp, h)
        out = self.head(xs + self.fc2(F.gelu(self.fc1(self.norm(xs)))))  # (b, s/tp, 3)
        return gather_from_tp(out, self.ctx.tp_group, dim=1)  # (b, s, 3)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, S, H, generator=g), torch.randn(ROWS, S, 3, generator=g)


def _reference() -> tuple[list[list[float]], list[dict], dict]:
    """Plain torch on the whole batch: (loss, norm) per step, grads per step, final weights."""
    torch.manual_seed(0)
    model = Dense()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    history, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        history.append([loss.item(), norm.item()])
        opt.step()
    return history, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _reduced_grads(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Every parameter's reduced (dp-averaged, tp-summed) logical gradient, from the dp shards."""
    out = {}
    for i, (name, p) in enumerate(zip(opt.names, opt.params)):
        flat = torch.zeros(p.numel())
        for pc, g in zip(opt.flat.pieces, opt.flat.piece_grads):
            if pc.param == i:
                flat[pc.start : pc.start + pc.numel] = g
        comm.all_reduce(flat, opt.ctx.dp_group)  # each element lives on exactly one dp rank
        info = getattr(p, "tp_shard", None)
        out[name] = (
            flat.view(p.shape)
            if info is None
            else unshard_tensor(flat.view(p.shape), info, opt.ctx.tp_group)
        )
    return out


def _sequence_parallel_zero(overlap: bool):
    ctx = context(tp=2)
    torch.manual_seed(0)
    model = SequenceParallel(Dense(), ctx)
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        ctx,
        overlap=overlap,
        bucket_numel=40,  # several buckets, sequence-parallel ones apart
        param_order=model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
    )
    rows = slice(ctx.dp_rank * ROWS // 2, (ctx.dp_rank + 1) * ROWS // 2)
    history, grads, refused = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        try:  # one owner of the tp sum: ZeRO makes it, a second one is refused
            sync_sequence_parallel_grads(model, ctx.tp_group)
        except ValueError as err:
            refused.append(str(err))
        norm = opt.grad_norm()
        grads.append(_reduced_grads(opt))
        clipped = opt.clip_grad_norm_(0.5)
        history.append([comm.all_reduce(loss.detach(), ctx.dp_group, "avg").item(), norm.item()])
        assert clipped.item() == norm.item()
        opt.step()
    weights = {n: full_tensor(p, ctx.tp_group) for n, p in model.named_parameters()}
    del opt
    gc.collect()  # its mark goes with it: a plain optimizer's user may sync again
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sync_sequence_parallel_grads(model, ctx.tp_group)
    synced = model.norm.weight.grad[0].item()
    return history, grads, weights, refused, synced


@pytest.mark.parametrize("overlap", [True, False])
def test_sequence_parallel_through_zero_matches_one_process(overlap):
    """Loss, reduced gradients, grad norm and weights after AdamW steps at tp=2 x dp=2 with
    sequence-parallel layers equal one process on the whole batch (not bitwise: the dp ranks'
    means and the tp sums add in another order)."""
    ref_history, ref_grads, ref_weights = _reference()
    for history, grads, weights, refused, synced in run_ranks(
        _sequence_parallel_zero, 4, overlap, timeout=60
    ):
        assert_close(torch.tensor(history), torch.tensor(ref_history), **TOL)
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            for n, g in want.items():
                assert_close(got[n], g, **TOL, msg=f"step {step}: {n}")
        for n, w in ref_weights.items():
            assert_close(weights[n], w, **TOL, msg=n)
        assert len(refused) == STEPS and all("belong to a ZeroOptimizer" in m for m in refused)
        assert synced == 2.0  # without an owner the tp sum runs (ones from 2 tp ranks)

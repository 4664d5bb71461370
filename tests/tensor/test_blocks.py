"""Column-then-row blocks (an MLP and an attention block) against their dense originals."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from parallax.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_tp,
    heads_per_rank,
    sync_sequence_parallel_grads,
    unshard_tensor,
)
from parallax.testing import context, run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)


class DenseMLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    def __init__(self, dense: DenseMLP, ctx, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear.from_dense(
            dense.fc1, ctx, sequence_parallel=sequence_parallel
        )
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, ctx, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class DenseAttention(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, hd)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


class ParallelAttention(nn.Module):
    def __init__(self, dense: DenseAttention, ctx) -> None:
        super().__init__()
        self.heads = heads_per_rank(dense.heads, ctx.tp_size, "test attention")
        self.qkv = ColumnParallelLinear.from_dense(dense.qkv, ctx, partitions=3)
        self.proj = RowParallelLinear.from_dense(dense.proj, ctx)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads/tp, s, hd)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))  # (b, s, h)


def _block(tp, kind, sequence_parallel=False):
    ctx = context(tp=tp)
    torch.manual_seed(0)
    dense = DenseMLP(16, 32) if kind == "mlp" else DenseAttention(16, 4)
    x = torch.randn(2, 8, 16)
    target = torch.randn(2, 8, 16)
    ref = F.mse_loss(dense(x), target)
    ref.backward()
    par = (
        ParallelMLP(dense, ctx, sequence_parallel)
        if kind == "mlp"
        else ParallelAttention(dense, ctx)
    )
    if sequence_parallel:  # activations arrive and leave split along the sequence
        xs = x.chunk(tp, dim=1)[ctx.tp_rank]
        out = gather_from_tp(par(xs), ctx.tp_group, dim=1)  # every rank takes the full loss
    else:
        out = par(x)
    loss = F.mse_loss(out, target)
    assert_close(loss, ref.detach(), **TOL)
    loss.backward()
    sync_sequence_parallel_grads(par, ctx.tp_group)
    dense_params = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        grad = (
            p.grad
            if not hasattr(p, "tp_shard")
            else unshard_tensor(p.grad, p.tp_shard, ctx.tp_group)
        )
        assert_close(grad, dense_params[name].grad, **TOL, msg=name)
    return loss.item()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_block_matches_dense(tp, kind):
    losses = run_ranks(_block, tp, tp, kind)
    assert len(set(losses)) == 1  # every tp rank reports the same loss


def test_sequence_parallel_mlp():
    run_ranks(_block, 2, 2, "mlp", True)


def _heads_do_not_divide():
    ctx = context(tp=4)
    try:
        ParallelAttention(DenseAttention(12, 6), ctx)
    except ValueError as err:
        return str(err)
    return None


def test_heads_not_divisible_fail_on_every_rank():
    messages = run_ranks(_heads_do_not_divide, 4, timeout=30)
    assert all(m and "6 heads cannot be split over tp=4" in m for m in messages)

"""Every tp layer against the dense module it came from: outputs, input grads, weight grads."""

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from parallax import comm
from parallax.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_tensor,
    shard_tensor,
    unshard_tensor,
)
from parallax.tensor.sharding import make_shard
from parallax.testing import context, run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)


def _grad_of(layer_param):
    """The full logical gradient of a (possibly sharded) parameter."""
    g = layer_param.grad.detach()
    info = getattr(layer_param, "tp_shard", None)
    if info is None:
        return g
    return unshard_tensor(g, info, _GROUP[0])


_GROUP = [None]


def _compare_linear(kind, tp, in_f, out_f, opt, bias, partitions=1):
    ctx = context(tp=tp)
    _GROUP[0] = ctx.tp_group
    torch.manual_seed(0)
    dense = nn.Linear(in_f, out_f, bias=bias)
    x = torch.randn(3, 5, in_f)
    grad_out = torch.randn(3, 5, out_f)

    xd = x.clone().requires_grad_()
    (dense(xd) * grad_out).sum().backward()

    if kind == "column":
        layer = ColumnParallelLinear.from_dense(
            dense, ctx, gather_output=opt, partitions=partitions
        )
        xp = x.clone().requires_grad_()
        y = layer(xp)
        if opt:
            assert y.shape == (3, 5, out_f)
            target_grad = grad_out
            y_ref = dense(x)
        else:
            info = layer.weight.tp_shard
            target_grad = shard_tensor(grad_out, replace(info, dim=-1))
            y_ref = shard_tensor(dense(x).detach(), replace(info, dim=-1))
    else:
        layer = RowParallelLinear.from_dense(dense, ctx, input_is_parallel=opt)
        if opt:
            info = layer.weight.tp_shard
            xp = shard_tensor(x, replace(info, dim=-1)).requires_grad_()
        else:
            xp = x.clone().requires_grad_()
        y = layer(xp)
        target_grad, y_ref = grad_out, dense(x)
    assert_close(y, y_ref.detach(), **TOL)
    (y * target_grad).sum().backward()

    assert_close(_grad_of(layer.weight), dense.weight.grad, **TOL)
    if bias:
        assert_close(_grad_of(layer.bias), dense.bias.grad, **TOL)
    if kind == "row" and opt:
        assert_close(xp.grad, shard_tensor(xd.grad, replace(info, dim=-1)), **TOL)
    else:
        assert_close(xp.grad, xd.grad, **TOL)
    back = layer.to_dense()
    assert_close(back.weight, dense.weight, rtol=0, atol=0)
    if bias:  # split over tp (column) or whole (row): gathered back exactly either way
        assert_close(back.bias, dense.bias, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_linear(tp):
    cases = [(16, 12, True, True), (16, 12, False, True), (8, 24, False, False)]
    for in_f, out_f, gather, bias in cases:
        assert all(run_ranks(_compare_linear, tp, "column", tp, in_f, out_f, gather, bias))


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_linear(tp):
    for in_f, out_f, parallel_in, bias in [
        (16, 12, True, True),
        (24, 8, False, True),
        (16, 8, True, False),
    ]:
        assert all(run_ranks(_compare_linear, tp, "row", tp, in_f, out_f, parallel_in, bias))


def test_fused_column_parallel_linear_keeps_blocks_together():
    # A fused QKV weight (3 blocks of 8 rows): each rank must own its slice of each block.
    assert all(run_ranks(_compare_linear, 2, "column", 2, 8, 24, False, True, 3))
    assert all(run_ranks(_fused_layout, 2))


def _fused_layout():
    ctx = context(tp=2)
    dense = nn.Linear(4, 12, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.arange(12.0).unsqueeze(1).expand(12, 4))
    layer = ColumnParallelLinear.from_dense(dense, ctx, partitions=3)
    rows = layer.weight[:, 0].tolist()
    expected = [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]][ctx.tp_rank]
    assert rows == expected, rows
    return True


def _embedding(tp, vocab, dim):
    ctx = context(tp=tp)
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, dim)
    ids = torch.randint(0, vocab, (4, 7))
    ids[0, :4] = torch.tensor([0, vocab - 1, vocab // 2, vocab - 2])  # the edges of the shards
    grad_out = torch.randn(4, 7, dim)
    (dense(ids) * grad_out).sum().backward()

    layer = VocabParallelEmbedding.from_dense(dense, ctx)
    rows = -(-vocab // tp)  # the vocabulary padded up to a multiple of tp, split evenly
    start, stop = ctx.tp_rank * rows, min((ctx.tp_rank + 1) * rows, vocab)
    assert layer.weight.shape == (rows, dim)
    assert (layer.vocab_start, layer.vocab_end) == (ctx.tp_rank * rows, (ctx.tp_rank + 1) * rows)
    assert torch.equal(layer.weight[: stop - start], dense.weight[start:stop].detach())  # a copy
    assert not layer.weight[stop - start :].any()  # the padding rows (last rank) are zero
    y = layer(ids)
    assert_close(y, dense(ids).detach(), **TOL)
    (y * grad_out).sum().backward()
    _GROUP[0] = ctx.tp_group
    assert_close(_grad_of(layer.weight), dense.weight.grad, **TOL)
    assert_close(layer.to_dense().weight, dense.weight, rtol=0, atol=0)
    # padded rows are zero and stay out of the logical tensor
    assert full_tensor(layer.weight, ctx.tp_group).shape == (vocab, dim)
    return True


@pytest.mark.parametrize("tp,vocab", [(2, 1003), (4, 1003), (4, 64)])
def test_vocab_parallel_embedding(tp, vocab):
    assert all(run_ranks(_embedding, tp, tp, vocab, 6))


def test_single_process_layers_match_dense():
    """Column-parallel at tp=1 makes the very call ``nn.Linear`` makes (``F.linear`` with the
    bias), the embedding the same lookup: bitwise. Row-parallel adds its bias after the matmul
    (after the tp sum), ``nn.Linear`` inside it: another rounding, so within float tolerance."""
    torch.manual_seed(0)
    dense = nn.Linear(6, 4)
    x = torch.randn(2, 6)
    assert torch.equal(ColumnParallelLinear.from_dense(dense, None)(x), dense(x))
    assert_close(RowParallelLinear.from_dense(dense, None)(x), dense(x), **TOL)
    emb = nn.Embedding(10, 3)
    ids = torch.tensor([[1, 9]])
    assert torch.equal(VocabParallelEmbedding.from_dense(emb, None)(ids), emb(ids))


def _replicated_parameters(tp: int) -> list[str]:
    """Each tp rank seeds its generator differently (as a user seeding per rank would), then
    builds every layer directly, with no init afterwards; returns the replicated parameters
    (those without ``tp_shard``) whose value differs between the tp ranks."""
    ctx = context(tp=tp)
    torch.manual_seed(100 + ctx.rank)
    layers = {
        "column": ColumnParallelLinear(8, 12, ctx=ctx),
        "column_gathered": ColumnParallelLinear(8, 12, gather_output=True, ctx=ctx),
        "row": RowParallelLinear(12, 6, ctx=ctx),
        "row_full_input": RowParallelLinear(12, 6, input_is_parallel=False, ctx=ctx),
        "row_sp": RowParallelLinear(12, 6, sequence_parallel=True, ctx=ctx),
        "embedding": VocabParallelEmbedding(10, 4, ctx=ctx),
    }
    differ, replicated = [], 0
    for kind, layer in layers.items():
        for name, p in layer.named_parameters():
            if hasattr(p, "tp_shard"):
                continue
            replicated += 1
            copies = comm.all_gather(p.detach()[None], ctx.tp_group, dim=0)  # (tp, ...)
            if not all(torch.equal(c, copies[0]) for c in copies):
                differ.append(f"{kind}.{name}")
    assert replicated == 3  # the three row-parallel biases: the check is not vacuous
    return differ


def test_replicated_parameters_are_identical_on_every_tp_rank():
    """Identical by construction, whatever each rank's random state: no init or from_dense
    needed for the ranks to hold one logical value."""
    assert run_ranks(_replicated_parameters, 2, 2) == [[], []]


def test_sizes_that_do_not_divide_raise():
    with pytest.raises(ValueError, match="out_features=10.*not divisible by tp=4"):
        make_shard(0, 10, 0, 4, what="ColumnParallelLinear out_features=10")
    with pytest.raises(ValueError, match="3 fused blocks"):
        make_shard(0, 12, 0, 8, partitions=3)

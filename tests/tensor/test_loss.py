"""vocab_parallel_cross_entropy against F.cross_entropy on the full logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from parallax.tensor import ColumnParallelLinear, vocab_parallel_cross_entropy
from parallax.tensor.sharding import make_shard, shard_tensor, unshard_tensor
from parallax.testing import context, run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)


def _ce(tp, vocab, reduction):
    ctx = context(tp=tp)
    torch.manual_seed(1)
    logits = torch.randn(3, 9, vocab) * 3
    target = torch.randint(0, vocab, (3, 9))
    target[0, :3] = -100  # ignored
    target[1, :4] = torch.tensor([0, vocab - 1, vocab // 2, vocab // 2 - 1])  # shard edges
    info = make_shard(-1, vocab, ctx.tp_rank, tp, pad=True)

    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(
        ref_in.flatten(0, 1), target.flatten(), ignore_index=-100, reduction=reduction
    )
    if reduction == "none":
        ref = ref.view(3, 9)
    ref_grad_out = torch.randn_like(ref)
    (ref * ref_grad_out).sum().backward()

    local = shard_tensor(logits, info).requires_grad_()  # padded columns hold zeros
    loss = vocab_parallel_cross_entropy(local, target, ctx, reduction=reduction, vocab_size=vocab)
    assert_close(loss, ref.detach(), **TOL)
    (loss * ref_grad_out).sum().backward()
    grad = unshard_tensor(local.grad, info, ctx.tp_group)
    assert_close(grad, ref_in.grad, **TOL)
    pad_cols = local.grad[..., max(0, vocab - info.ranges()[0][0]) :]
    assert pad_cols.abs().sum() == 0  # padded rows never get gradient
    return True


@pytest.mark.parametrize("tp,vocab", [(2, 1003), (4, 1003), (2, 64)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(tp, vocab, reduction):
    assert all(run_ranks(_ce, tp, tp, vocab, reduction))


def _lm_head(tp):
    """A padded column-parallel lm_head feeding the loss matches nn.Linear + F.cross_entropy."""
    ctx = context(tp=tp)
    torch.manual_seed(2)
    dense = torch.nn.Linear(8, 1003, bias=False)
    x = torch.randn(4, 8)
    target = torch.randint(0, 1003, (4,))
    F.cross_entropy(dense(x), target).backward()
    head = ColumnParallelLinear.from_dense(dense, ctx, pad=True)
    loss = vocab_parallel_cross_entropy(head(x), target, ctx, vocab_size=1003)
    assert_close(loss, F.cross_entropy(dense(x), target).detach(), **TOL)
    loss.backward()
    grad = unshard_tensor(head.weight.grad, head.weight.tp_shard, ctx.tp_group)
    assert_close(grad, dense.weight.grad, **TOL)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_padded_lm_head_and_loss(tp):
    assert all(run_ranks(_lm_head, tp, tp))


def test_single_process_matches_torch():
    torch.manual_seed(3)
    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, -100, 10, 0, 5])
    ours = vocab_parallel_cross_entropy(logits, target, None)
    ref = F.cross_entropy(logits, target)
    assert_close(ours.double(), ref, rtol=1e-6, atol=1e-7)


def test_bad_reduction_and_shapes():
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(
            torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), None, reduction="avg"
        )
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), None)

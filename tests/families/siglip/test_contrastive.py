"""The contrastive losses across dp equal the single-process loss over the global batch.

Each layout trains the tiny SigLIP (sigmoid ring) and CLIP (softmax with gathered features)
for one ZeroOptimizer SGD step from the same layout-free init and compares, against one process
that runs the whole global batch through the same model and the dense formula, the reported
loss and every updated weight (towers, logit_scale, logit_bias). SGD at a large learning rate:
the updates then dominate the weights, so the comparison measures the gradients to float32
precision (a gradient scaled by dp, the trap of gathering with gradient without local rows,
would be off by far more), while AdamW's step would hide a scale error. Where a layout has two
microbatches per rank, the step goes through GradCache.
"""

import pytest
import torch

from parallax.families.siglip.model import Siglip
from parallax.families.siglip.step import contrastive_step
from parallax.optim import ZeroOptimizer
from parallax.tensor import full_tensor
from parallax.tensor.contrastive import sigmoid_loss
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import assert_rel_close
from tests.families.siglip.helpers import SEED, make_pairs, perturbed_init, reference_loss, tiny

LR = 100.0
LOCAL = 2  # pairs per dp rank


def _model(cfg, ctx=None):
    model = Siglip(cfg, ctx)
    model.init_weights(SEED, perturbed_init)
    return model


def _reference_step(cfg, px, ids):
    model = _model(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = model(px, ids)
    loss = reference_loss(
        cfg.family, out.image_embeds, out.text_embeds, model.logit_scale, model.logit_bias
    )
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), before, dict(model.named_parameters())


def _layout_case(tp: int, dp: int, microbatches: int) -> None:
    ctx = context(tp=tp, dp=dp)
    for family in ("siglip", "clip"):
        cfg = tiny(family)
        px, ids = make_pairs(cfg, dp * LOCAL, seed=dp)
        ref_loss, before, ref_after = _reference_step(cfg, px, ids)
        model = _model(cfg, ctx)
        opt = ZeroOptimizer(
            model.named_parameters(),
            torch.optim.SGD,
            ctx,
            lr=LR,
            backward_passes_per_step=microbatches,
        )
        mine = slice(ctx.dp_rank * LOCAL, (ctx.dp_rank + 1) * LOCAL)
        m = LOCAL // microbatches
        mbs = [(px[mine][k : k + m], ids[mine][k : k + m]) for k in range(0, LOCAL, m)]
        result = contrastive_step(model, mbs)
        opt.step()
        assert_rel_close(result.loss, ref_loss, msg=f"{family} loss")
        for name, p in model.named_parameters():
            update = full_tensor(p, ctx.tp_group) - before[name]
            assert_rel_close(update, ref_after[name] - before[name], msg=f"{family} {name}")


@pytest.mark.parametrize(
    "tp, dp, microbatches",
    [(1, 2, 2), (1, 3, 1), (1, 4, 1), (2, 2, 2)],
    ids=["dp2-gradcache", "dp3", "dp4", "tp2-dp2-gradcache"],
)
def test_losses_equal_single_process(tp, dp, microbatches):
    run_ranks(_layout_case, tp * dp, tp, dp, microbatches)


def test_gradcache_equals_one_big_batch():
    """One process: two cached microbatches give the gradients of one batch of both."""
    for family in ("siglip", "clip"):
        cfg = tiny(family)
        px, ids = make_pairs(cfg, 6, seed=3)
        grads = []
        for mbs in ([(px, ids)], [(px[:3], ids[:3]), (px[3:], ids[3:])]):
            model = _model(cfg)
            result = contrastive_step(model, mbs)
            grads.append({n: p.grad for n, p in model.named_parameters()})
        ref_loss, _, _ = _reference_step(cfg, px, ids)
        assert_rel_close(result.loss, ref_loss, msg="loss")
        for name, g in grads[0].items():
            assert_rel_close(grads[1][name], g, msg=f"{family} {name}")


def _ring_memory_case(local: int, dim: int) -> dict:
    """dp 8, features only: the ring's loss and gradients against the dense loss, and the
    shapes of every logits block it computed and of everything autograd kept."""
    ctx = context(dp=8)
    g = torch.Generator().manual_seed(11)
    x_all, y_all = (
        torch.randn(8 * local, dim, generator=g),
        torch.randn(8 * local, dim, generator=g),
    )
    scale, bias = torch.tensor([1.5], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    mine = slice(ctx.dp_rank * local, (ctx.dp_rank + 1) * local)
    x = x_all[mine].clone().requires_grad_()
    y = y_all[mine].clone().requires_grad_()
    trace, saved = [], []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        xn, yn = torch.nn.functional.normalize(x, dim=-1), torch.nn.functional.normalize(y, dim=-1)
        loss = sigmoid_loss(xn, yn, scale, bias, ctx, trace=trace)
    loss.backward()
    xr, yr = x_all.clone().requires_grad_(), y_all.clone().requires_grad_()
    sr, br = scale.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    ref = reference_loss("siglip", xr, yr, sr, br)
    ref.backward()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=ctx.dp_group)
    assert_rel_close(total / 8, ref.detach(), msg="loss")
    # this rank's embedding gradients are those of the sum of every rank's loss (8 x global)
    assert_rel_close(x.grad, 8 * xr.grad[mine], msg="image grad")
    assert_rel_close(y.grad, 8 * yr.grad[mine], msg="text grad")
    gs = torch.cat([scale.grad, bias.grad])
    torch.distributed.all_reduce(gs, group=ctx.dp_group)
    assert_rel_close(gs / 8, torch.cat([sr.grad, br.grad]), msg="scale, bias grads")
    return {"blocks": trace, "saved": saved}


def test_ring_memory_grows_with_local_batch_only():
    """At dp 8 every logits block is local x local (global batch 8x larger), and the loss keeps
    nothing of the global batch for its backward."""
    for local, dim in ((2, 4), (3, 4)):
        results = run_ranks(_ring_memory_case, 8, local, dim)
        for r in results:
            assert set(r["blocks"]) == {(local, local)}
            assert len(r["blocks"]) == 2 * 8  # each block once forward, once backward
            assert max(s[0] if s else 1 for s in r["saved"]) <= local  # no (8 * local, ...)

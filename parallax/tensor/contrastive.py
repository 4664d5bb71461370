"""Contrastive image-text losses over the data-parallel group, without a global logits matrix.

Both functions return **this rank's loss**: the loss of its own ``b`` images (and, for the
softmax, its own ``b`` texts) against all ``B = dp * b`` pairs of the global batch, averaged over
its ``b`` rows. The mean of these over dp is exactly the single-process loss over the global
batch, so backpropagating this rank's loss and letting ZeRO **average** the gradients over dp
(:class:`~parallax.optim.ZeroOptimizer` does) gives the single-process global-batch gradient:
each collective's backward sums (never averages) what the other ranks' losses say about this
rank's embeddings. The value to report is that dp mean (:func:`global_loss`).

Sigmoid (SigLIP): ``L = -1/B sum_i sum_j log sigmoid(z_ij (t <x_i, y_j> + b))``, ``z_ij = 1`` on the
diagonal, -1 elsewhere, ``t = exp(logit_scale)``. Each rank scores its own ``b x b`` block (the
positives), then text embeddings travel the dp ring in both directions (``ceil((dp-1)/2)``
rounds); each exchange is posted before the block in hand is scored, so they overlap. Nothing
of size ``B`` is kept: the backward passes the texts around again, each with a gradient
accumulator that every rank on its way adds to and that finally goes home to the text's owner.
Memory per rank is ``O(b^2 + b d)`` whatever dp is; the price is one more trip of the texts
(three ``b x d`` transfers per hop in all, against two when the received texts are kept).

Softmax (CLIP): ``L = (CE(l, labels) + CE(l^T, labels)) / 2`` with ``l = t X Y^T (+ b)``. Each rank
all-gathers both embeddings with gradient (backward: reduce-scatter of the **sum**) and computes
only its own rows of ``l`` and of ``l^T`` against the gathered columns, labels offset by its
position. Its memory is ``O(b B)``, as any softmax over all negatives needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallax import comm
from parallax.context import ParallelContext
from parallax.tensor.contrastive_ring import Ring, sigmoid_ring_loss

__all__ = [
    "Ring",
    "contrastive_loss",
    "gather_with_grad",
    "global_loss",
    "sigmoid_loss",
    "softmax_loss",
]


def _dp(ctx: ParallelContext | None):
    if ctx is None or ctx.dp_size == 1:
        return None, 0, 1
    return ctx.dp_group, ctx.dp_rank, ctx.dp_size


def _check(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> None:
    if image_embeds.dim() != 2 or image_embeds.shape != text_embeds.shape:
        raise ValueError(
            "image and text embeddings must both be (b, d) with the same shape, got "
            f"{tuple(image_embeds.shape)} and {tuple(text_embeds.shape)}"
        )


def sigmoid_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
    ctx: ParallelContext | None = None,
    *,
    trace: list | None = None,
) -> torch.Tensor:
    """This rank's SigLIP loss (see the module doc); fp32 whatever the embeddings' dtype.
    ``trace``: a list that receives the shape of every logits block computed."""
    _check(image_embeds, text_embeds)
    group, dp_rank, dp = _dp(ctx)
    ring = Ring(group, ctx.dp_ranks if dp > 1 else [0], dp_rank)
    return sigmoid_ring_loss(image_embeds, text_embeds, logit_scale, logit_bias, ring, trace)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0; the backward sums every rank's gradient of the gathered tensor
    and keeps this rank's rows (a reduce-scatter): each rank's loss covers only its own rows,
    so the sum is the whole gradient of the global loss times dp, which ZeRO's average undoes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        return comm.all_gather(x.contiguous(), group, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return comm.reduce_scatter(grad.contiguous(), ctx.group, dim=0, op="sum"), None


def gather_with_grad(x: torch.Tensor, ctx: ParallelContext | None) -> torch.Tensor:
    """Every dp rank's ``x`` (b, ...) concatenated in dp order: ``(dp * b, ...)``."""
    group, _, dp = _dp(ctx)
    return x if dp == 1 else _GatherWithGrad.apply(x, group)


def softmax_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
    ctx: ParallelContext | None = None,
    *,
    trace: list | None = None,
) -> torch.Tensor:
    """This rank's CLIP loss (see the module doc), in fp32."""
    _check(image_embeds, text_embeds)
    _, dp_rank, _ = _dp(ctx)
    x, y = image_embeds.float(), text_embeds.float()
    all_x, all_y = gather_with_grad(x, ctx), gather_with_grad(y, ctx)  # (B, d)
    t = logit_scale.float().exp()
    rows_i = t * x @ all_y.T  # (b, B): my images against every text
    rows_t = t * y @ all_x.T  # (b, B): my texts against every image
    if logit_bias is not None:
        rows_i, rows_t = rows_i + logit_bias.float(), rows_t + logit_bias.float()
    if trace is not None:
        trace.extend([tuple(rows_i.shape), tuple(rows_t.shape)])
    labels = torch.arange(x.shape[0], device=x.device) + dp_rank * x.shape[0]
    return (F.cross_entropy(rows_i, labels) + F.cross_entropy(rows_t, labels)) / 2


def contrastive_loss(kind: str, image_embeds, text_embeds, logit_scale, logit_bias, ctx, **kw):
    """:func:`sigmoid_loss` (``kind="sigmoid"``) or :func:`softmax_loss` (``"softmax"``)."""
    if kind == "sigmoid":
        if logit_bias is None:
            raise ValueError("the sigmoid loss needs a logit_bias")
        return sigmoid_loss(image_embeds, text_embeds, logit_scale, logit_bias, ctx, **kw)
    if kind == "softmax":
        return softmax_loss(image_embeds, text_embeds, logit_scale, logit_bias, ctx, **kw)
    raise ValueError(f"unknown contrastive loss {kind!r}; use 'sigmoid' or 'softmax'")


def global_loss(local_loss: torch.Tensor, ctx: ParallelContext | None) -> torch.Tensor:
    """The loss over the global batch: the dp mean of every rank's loss (detached; a
    collective over dp: call it on every dp rank)."""
    out = local_loss.detach().float().clone()
    group, _, _ = _dp(ctx)
    return comm.all_reduce(out, group, op="avg")

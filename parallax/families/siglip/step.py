"""One optimizer step's forward and backward for a dual encoder, over all its microbatches.

Gradient accumulation would shrink the negatives of a contrastive loss to one microbatch per
rank. :func:`contrastive_step` instead caches embeddings (GradCache, Gao et al. 2021): it embeds
every microbatch without autograd, computes the loss of the **whole step** (all microbatches of
all dp ranks: ``global batch = dp x microbatches x micro batch size`` pairs, every one a negative
of every other) and the gradient of that loss with respect to each embedding, then runs each
microbatch's forward again with autograd and backpropagates its slice of those gradients. The
parameter gradients are exactly those of one big batch, while only one microbatch's activations
live at a time. The price is one extra forward per microbatch (not counted as model FLOPs, like
activation checkpointing). With one microbatch there is nothing to cache and the step is a
plain forward and backward.

The loss is not divided by the number of microbatches: it already covers them all. Towers get
one gradient accumulation per microbatch; ``logit_scale``/``logit_bias`` one per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parallax.tensor.contrastive import global_loss

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (pixel_values (m, 3, S, S), input_ids (m, t))


@dataclass
class StepResult:
    """``loss``: the global-batch loss (dp mean of every rank's ``local_loss``), detached fp32,
    the same on every rank; ``samples``: this rank's pairs."""

    loss: torch.Tensor
    local_loss: torch.Tensor
    samples: int


def _check(microbatches: Sequence[Microbatch]) -> None:
    if not microbatches:
        raise ValueError("contrastive_step needs at least one microbatch")
    for i, mb in enumerate(microbatches):
        if len(mb) != 2 or mb[0].shape[0] != mb[1].shape[0]:
            raise ValueError(
                f"microbatch {i} must be (pixel_values, input_ids) with one caption per image"
            )


def contrastive_step(model, microbatches: Sequence[Microbatch], **loss_kwargs) -> StepResult:
    """Forward and backward of one step (see the module doc); gradients accumulate into the
    parameters' ``.grad`` (or a ZeroOptimizer's buffers). Collective over dp: every dp rank
    calls it with the same number of microbatches of the same size."""
    _check(microbatches)
    if len(microbatches) == 1:
        pixel_values, input_ids = microbatches[0]
        out = model(pixel_values, input_ids)
        local = model.loss(out.image_embeds, out.text_embeds, **loss_kwargs)
        local.backward()
        return StepResult(global_loss(local, model.ctx), local.detach(), pixel_values.shape[0])
    # through forward(), not encode_*: ZeRO's deferred all-gathers of the updated weights are
    # waited for in forward pre-hooks, and logit_scale/logit_bias belong to the model itself
    with torch.no_grad():
        outs = [model(px, ids) for px, ids in microbatches]
        cached = [(o.image_embeds, o.text_embeds) for o in outs]
        outs = None
    images = torch.cat([i for i, _ in cached]).requires_grad_()  # (b, d)
    texts = torch.cat([t for _, t in cached]).requires_grad_()  # (b, d)
    cached = None
    local = model.loss(images, texts, **loss_kwargs)
    local.backward()  # d loss / d embeddings; logit_scale and logit_bias get their gradient
    start = 0
    for pixel_values, input_ids in microbatches:
        stop = start + pixel_values.shape[0]
        out = model(pixel_values, input_ids)
        emb_i, emb_t = out.image_embeds, out.text_embeds
        torch.autograd.backward([emb_i, emb_t], [images.grad[start:stop], texts.grad[start:stop]])
        start = stop
    return StepResult(global_loss(local, model.ctx), local.detach(), start)

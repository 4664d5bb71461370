"""One evaluation batch of a dual encoder: the loss, retrieval hits and zero-shot hits, as sums.

The Evaluator (:mod:`parallax.train.evaluate`) adds the sums of ``--eval-batches`` global
batches and divides: recall@k is the share of queries (images for image->text, captions for
text->image) whose own pair is among the ``k`` most similar of the evaluation batch's
``--global-batch-size`` candidates (ties count against the query, as in
:func:`parallax.families.siglip.predict.retrieval_recall`); zero-shot top-k the share of
labelled images whose class prompt is among the ``k`` most similar of all class prompts.
Forward only; every sum is over the whole global batch (collectives over dp).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from parallax import comm
from parallax.families.siglip.predict import gather_embeddings
from parallax.tensor.contrastive import contrastive_loss


def _hits(sims: torch.Tensor, rows: slice, ks: Sequence[int]) -> list[torch.Tensor]:
    """For the query rows ``rows`` of ``sims (n, n)``: how many have their own column among
    the ``k`` best, per k."""
    own = sims.diagonal()[rows, None]
    rank = (sims[rows] >= own).sum(dim=1) - 1  # better or tied candidates
    return [(rank < k).sum().float() for k in ks]


@torch.no_grad()
def evaluate_batch(model, microbatches: Sequence[dict], ctx, ks: Sequence[int]) -> torch.Tensor:
    """``[loss sum, i2t hits per k, t2i hits per k, queries, zero-shot top-1 and top-5 hits,
    labelled images]`` over the global batch, the same on every rank."""
    dev = ctx.device
    images, texts = [], []
    for mb in microbatches:
        out = model(mb["pixel_values"].to(dev), mb["input_ids"].to(dev))
        images.append(out.image_embeds)
        texts.append(out.text_embeds)
    x, y = torch.cat(images), torch.cat(texts)  # (b, d) this rank's pairs
    b = x.shape[0]
    local = contrastive_loss(
        model.config.loss, x, y, model.logit_scale, model.logit_bias, model.ctx
    )
    all_x, all_y = gather_embeddings(x, ctx).float(), gather_embeddings(y, ctx).float()
    sims = all_x @ all_y.T  # (B, B)
    rank = ctx.dp_rank if ctx.dp_size > 1 else 0
    mine = slice(rank * b, (rank + 1) * b)  # each rank counts its own queries; summed over dp
    i2t, t2i = _hits(sims, mine, ks), _hits(sims.T, mine, ks)
    zs = _zero_shot(model, microbatches, x, dev)
    sums = torch.stack([local.float() * b, *i2t, *t2i, torch.tensor(float(b), device=dev), *zs])
    comm.all_reduce(sums, ctx.dp_group)
    return sums


def _zero_shot(model, microbatches: Sequence[dict], x: torch.Tensor, dev) -> list[torch.Tensor]:
    """Top-1 and top-5 hits and the labelled images among this rank's ``x``."""
    zero = torch.zeros((), device=dev)
    first = microbatches[0]
    if "labels" not in first or any("labels" not in mb for mb in microbatches):
        return [zero, zero, zero]
    labels = torch.cat([mb["labels"] for mb in microbatches]).to(dev)
    ids, per_class = first["class_ids"].to(dev), int(first["class_templates"])
    prompts = model.encode_text(ids).float()  # (C * T, d)
    classes = F.normalize(prompts.view(-1, per_class, prompts.shape[-1]).mean(dim=1), dim=-1)
    scores = x.float() @ classes.T  # (b, C)
    out = []
    for k in (1, 5):
        top = scores.topk(min(k, scores.shape[1]), dim=1).indices
        out.append((top == labels[:, None]).any(dim=1).sum().float())
    return [*out, torch.tensor(float(labels.numel()), device=dev)]

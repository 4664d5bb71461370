"""Evaluation of a dual encoder from embeddings: zero-shot accuracy and retrieval recall@k.

Each function takes this rank's L2-normalised embeddings and a context: retrieval gathers the
held-out split's embeddings of every dp rank (each rank then ranks the whole split, so the
numbers are those of one process over it), zero-shot classification sums its hit counts over
dp. They are collectives over dp: call them on every dp rank with the same number of rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from parallax import comm
from parallax.context import ParallelContext
from parallax.families.siglip.inputs import tokenize

DEFAULT_TEMPLATES = ("a photo of a {}.",)


@torch.no_grad()
def gather_embeddings(x: torch.Tensor, ctx: ParallelContext | None) -> torch.Tensor:
    """Every dp rank's rows of ``x``, in dp order (no gradient)."""
    if ctx is None or ctx.dp_size == 1:
        return x.detach()
    return comm.all_gather(x.detach().contiguous(), ctx.dp_group, dim=0)


@torch.no_grad()
def retrieval_recall(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    ctx: ParallelContext | None = None,
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, float]:
    """``image_to_text_r@k`` and ``text_to_image_r@k``: the share of queries whose own pair
    (row i with row i) ranks among the ``k`` most similar of the whole split; ties count
    against the query (a rank is the number of candidates scoring at least as high, minus
    itself)."""
    images = gather_embeddings(image_embeds, ctx).float()
    texts = gather_embeddings(text_embeds, ctx).float()
    if images.shape != texts.shape:
        raise ValueError(f"{images.shape[0]} images but {texts.shape[0]} texts: one pair each")
    sims = images @ texts.T  # (n, n)
    out = {}
    for name, s in (("image_to_text", sims), ("text_to_image", sims.T)):
        own = s.diagonal()[:, None]
        rank = (s >= own).sum(dim=1) - 1  # better or tied candidates
        for k in ks:
            out[f"{name}_r@{k}"] = (rank < k).float().mean().item()
    return out


@torch.no_grad()
def zero_shot_accuracy(
    image_embeds: torch.Tensor,
    labels: torch.Tensor,
    class_embeds: torch.Tensor,
    ctx: ParallelContext | None = None,
    ks: Sequence[int] = (1, 5),
) -> dict[str, float]:
    """``zero_shot_top{k}``: the share of images whose label is among the ``k`` classes whose
    prompt embedding (``class_embeds (C, d)``, :func:`class_embeddings`) is most similar, over
    the images of every dp rank."""
    scores = image_embeds.float() @ class_embeds.float().T  # (n, C)
    counts = []
    for k in ks:
        top = scores.topk(min(k, scores.shape[1]), dim=1).indices
        counts.append((top == labels[:, None].to(top.device)).any(dim=1).sum().float())
    totals = torch.stack([*counts, torch.tensor(float(labels.numel()), device=scores.device)])
    if ctx is not None and ctx.dp_size > 1:
        comm.all_reduce(totals, ctx.dp_group)
    return {f"zero_shot_top{k}": (totals[i] / totals[-1]).item() for i, k in enumerate(ks)}


@torch.no_grad()
def class_embeddings(
    model, class_names: Sequence[str], templates: Sequence[str] = DEFAULT_TEMPLATES, tokenizer=None
) -> torch.Tensor:
    """One embedding per class: its prompts (each template filled with the name) embedded,
    averaged and normalised again, as CLIP's zero-shot classifier does. ``(C, d)``."""

    tokenizer = tokenizer or model.tokenizer
    if tokenizer is None:
        raise ValueError("zero-shot prompts need a tokenizer (the model has none): pass one")
    prompts = [tpl.format(name) for name in class_names for tpl in templates]
    ids, _ = tokenize(tokenizer, prompts, model.config.text.max_length, model.config.text.pad_id)
    device = model.logit_scale.device
    emb = model.encode_text(ids.to(device)).float().view(len(class_names), len(templates), -1)
    return F.normalize(emb.mean(dim=1), dim=-1)

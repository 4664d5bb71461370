"""The next-token loss of a vision-language model on vocab-sharded logits, never gathered.

The multimodal sequence is ``[BOS, P image patches, text tokens 1..]``, so labels given per text
token ``(b, t)`` are expanded with ``-100`` at the patch positions and shifted by one, as Hugging
Face's ``LlamaForCausalLM`` does. Training only needs logits where a label is:
:func:`labelled_rows` lists those positions and :func:`rows_loss` gives the same sums as
:func:`vla_loss` from those rows alone. Sums and counts stay tensors (no host sync), so a trainer
adds them up over microbatches and dp ranks.
"""

from __future__ import annotations

import torch

from parallax.models.tokenizer import IGNORE_INDEX
from parallax.tensor import vocab_parallel_cross_entropy
from parallax.tensor.layers import TPLike


def expand_labels(labels: torch.Tensor, num_patches: int) -> torch.Tensor:
    """``(b, t)`` text labels -> ``(b, P + t)`` sequence labels, patches ignored."""
    patches = labels.new_full((labels.shape[0], num_patches), IGNORE_INDEX)
    return torch.cat([labels[:, :1], patches, labels[:, 1:]], dim=1)


def loss_token_count(labels: torch.Tensor) -> torch.Tensor:
    """How many tokens the loss counts for these text labels (the first label is never a target)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def vla_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ctx: TPLike,
    *,
    num_patches: int,
    vocab_size: int,
    reduction: str = "mean",
) -> torch.Tensor:
    """Next-token cross-entropy of the sequence logits ``(b, P + t, V/tp)`` against the text
    labels ``(b, t)``. ``vocab_size`` is the embedding's row count (32064): only tp padding
    beyond it is masked, as Hugging Face's loss sees all rows. ``reduction="sum"`` with
    :func:`loss_token_count` lets a trainer divide by the tokens of the whole global batch."""
    full = expand_labels(labels, num_patches)  # (b, P + t)
    if logits.shape[:2] != full.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not fit labels {tuple(labels.shape)} with "
            f"{num_patches} image patches: expected (b, {full.shape[1]}, V/tp)"
        )
    return vocab_parallel_cross_entropy(
        logits[:, :-1], full[:, 1:], ctx, reduction=reduction, vocab_size=vocab_size
    )


def labelled_rows(labels: torch.Tensor, num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence positions whose next token carries a label, as flat row indices into the
    ``(b * (P + t))`` hidden states, and those labels: ``(rows (n,), targets (n,))``.

    The count ``n`` depends on the labels' values: call it on host (CPU) labels, where it costs
    no device synchronisation, and move the result over with ``non_blocking=True``.
    """
    full = expand_labels(labels, num_patches)  # (b, P + t)
    nxt = full[:, 1:]  # (b, P + t - 1): the label each position predicts
    b_idx, pos = (nxt != IGNORE_INDEX).nonzero(as_tuple=True)  # (n,), (n,)
    rows = b_idx * full.shape[1] + pos  # (n,) into the flattened (b * (P + t))
    return rows, nxt[b_idx, pos]


def rows_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ctx: TPLike,
    *,
    vocab_size: int,
    reduction: str = "sum",
) -> torch.Tensor:
    """Cross-entropy of the logits of :func:`labelled_rows` ``(n, V/tp)`` against their
    ``targets (n,)``: the labelled terms of :func:`vla_loss`, so the sums agree."""
    return vocab_parallel_cross_entropy(
        logits, targets, ctx, reduction=reduction, vocab_size=vocab_size
    )

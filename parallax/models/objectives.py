"""OpenVLA's training loss and action metrics on vocab-sharded logits, without gathering them.

The multimodal sequence is ``[BOS, P image patches, text tokens 1..]``, so labels given per text
token ``(b, t)`` are expanded with ``-100`` at the patch positions and shifted by one, as Hugging
Face's ``LlamaForCausalLM`` does. Metrics follow OpenVLA's fine-tuning script: predictions are
``argmax(logits[:, P:-1])`` against ``labels[:, 1:]`` on the tokens that are actions, accuracy
and L1 distance between bin centres in normalised [-1, 1] space. Everything is returned as sums
and counts (tensors, no host sync) so a trainer can add them up over microbatches and dp ranks.

Training only needs logits where a label is: :func:`labelled_rows` lists those positions (a few
per sample against ``P + t``), and :func:`rows_loss` / :func:`rows_action_metrics` give the same
sums as :func:`vla_loss` / :func:`action_metrics` from the logits of those rows alone.
"""

from __future__ import annotations

import torch

from parallax import comm
from parallax.models.action_tokenizer import ActionTokenizer
from parallax.models.tokenizer import IGNORE_INDEX
from parallax.tensor import resolve_tp, vocab_parallel_cross_entropy
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


def tp_argmax(logits: torch.Tensor, ctx: TPLike, vocab_size: int | None = None) -> torch.Tensor:
    """Global argmax ids ``(...)`` of logits whose last dim is this rank's vocab shard.

    Each rank takes its own maximum and index; a max-reduction finds the winning value and a
    min-reduction over the ranks holding it picks the lowest id, as ``torch.argmax`` would.
    """
    group, tp_rank, tp_size = resolve_tp(ctx)
    local_v = logits.shape[-1]
    start = tp_rank * local_v
    z = logits
    if vocab_size is not None and start + local_v > vocab_size:
        cols = torch.arange(start, start + local_v, device=z.device)
        z = z.masked_fill(cols >= vocab_size, float("-inf"))  # tp padding never wins
    idx = z.argmax(dim=-1)  # (...)
    if tp_size == 1:
        return idx
    val = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).float()
    best = comm.all_reduce(val.clone(), group, op="max")
    cand = torch.where(val == best, idx + start, torch.full_like(idx, torch.iinfo(idx.dtype).max))
    return comm.all_reduce(cand, group, op="min")


def action_metrics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ctx: TPLike,
    *,
    num_patches: int,
    vocab_size: int,
    action_tokenizer: ActionTokenizer,
) -> dict[str, torch.Tensor]:
    """``action_correct``, ``action_l1_sum`` and ``action_tokens`` (float32 scalars).

    accuracy = correct / tokens; l1 = l1_sum / tokens (normalised action space).
    """
    with torch.no_grad():
        pred = tp_argmax(logits[:, num_patches:-1], ctx, vocab_size)  # (b, t - 1)
        return _action_sums(pred, labels[:, 1:], action_tokenizer)  # against (b, t - 1)


def rows_action_metrics(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ctx: TPLike,
    *,
    vocab_size: int,
    action_tokenizer: ActionTokenizer,
) -> dict[str, torch.Tensor]:
    """:func:`action_metrics` from the logits of :func:`labelled_rows` ``(n, V/tp)``: action
    tokens are labelled, so every position the metrics count is among the rows."""
    with torch.no_grad():
        pred = tp_argmax(logits, ctx, vocab_size)  # (n,)
        return _action_sums(pred, targets, action_tokenizer)


def _action_sums(
    pred: torch.Tensor, gt: torch.Tensor, action_tokenizer: ActionTokenizer
) -> dict[str, torch.Tensor]:
    mask = action_tokenizer.is_action(gt)
    correct = ((pred == gt) & mask).sum().float()
    dist = (action_tokenizer.decode_torch(pred) - action_tokenizer.decode_torch(gt)).abs()
    l1 = (dist * mask).sum()
    return {"action_correct": correct, "action_l1_sum": l1, "action_tokens": mask.sum().float()}

"""LLaVA-NeXT's training loss and answer metrics on vocab-sharded logits, without gathering them.

The sequence is the token sequence itself (image tokens already expanded in ``input_ids``), so
labels ``(b, t)`` line up with the logits position by position and the loss is Hugging Face's
shifted cross-entropy: position ``i`` predicts ``labels[:, i + 1]``; image tokens, the prompt
and the padding carry ``-100``. These are OpenVLA's objectives with no patch block in front
(``num_patches=0``), including the labelled-rows path (:func:`labelled_rows`) that applies the
head only where a label is.

Metrics, as sums a trainer adds up over microbatches and dp ranks (float32 tensors, no host
sync): ``token_correct`` / ``tokens`` (teacher-forced next-token accuracy on the supervised
tokens) and ``answers_correct`` / ``answers`` (samples whose every supervised token is right,
i.e. exact-match accuracy of the answers under teacher forcing).
"""

from __future__ import annotations

from typing import Any

import torch

from parallax.models import next_token as objectives
from parallax.models.tokenizer import IGNORE_INDEX
from parallax.recipe import MetricSpec, Microbatch, NextTokenObjective
from parallax.run import Run
from parallax.tensor.layers import TPLike
from parallax.tensor.loss import tp_argmax


def llava_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ctx: TPLike,
    *,
    vocab_size: int,
    reduction: str = "mean",
) -> torch.Tensor:
    """Shifted cross-entropy of logits ``(b, t, V/tp)`` against labels ``(b, t)``; only the tp
    padding beyond ``vocab_size`` is masked. ``reduction="sum"`` with :func:`loss_token_count`
    lets a trainer divide by the supervised tokens of the whole global batch."""
    return objectives.vla_loss(
        logits, labels, ctx, num_patches=0, vocab_size=vocab_size, reduction=reduction
    )


def loss_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Supervised tokens of these labels (the first position is never a target)."""
    return objectives.loss_token_count(labels)


def labelled_rows(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat row indices into the ``(b * t)`` hidden states whose next token is labelled, and
    those labels (call it on host labels: the count depends on their values)."""
    return objectives.labelled_rows(labels, 0)


def rows_loss(logits, targets, ctx: TPLike, *, vocab_size: int, reduction: str = "sum"):
    """Cross-entropy of the :func:`labelled_rows` logits ``(n, V/tp)``: the same sum as
    :func:`llava_loss` with ``reduction="sum"``."""
    return objectives.rows_loss(logits, targets, ctx, vocab_size=vocab_size, reduction=reduction)


def _sums(correct: torch.Tensor, sample: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
    """Metric sums from per-token correctness ``(n,)`` and each token's sample index ``(n,)``."""
    wrong = torch.zeros(batch, device=correct.device).index_add_(0, sample, (~correct).float())
    ones = torch.ones(sample.shape[0], device=correct.device)
    count = torch.zeros(batch, device=correct.device).index_add_(0, sample, ones)
    answered = count > 0
    return {
        "token_correct": correct.sum().float(),
        "tokens": torch.tensor(float(correct.numel()), device=correct.device),
        "answers_correct": (answered & (wrong == 0)).sum().float(),
        "answers": answered.sum().float(),
    }


def answer_metrics(
    logits: torch.Tensor, labels: torch.Tensor, ctx: TPLike, *, vocab_size: int
) -> dict[str, torch.Tensor]:
    """Teacher-forced token and answer accuracy sums from logits ``(b, t, V/tp)``."""
    with torch.no_grad():
        pred = tp_argmax(logits[:, :-1], ctx, vocab_size)  # (b, t - 1)
        gt = labels[:, 1:].to(pred.device)
        b_idx, pos = (gt != IGNORE_INDEX).nonzero(as_tuple=True)
        return _sums(pred[b_idx, pos] == gt[b_idx, pos], b_idx, labels.shape[0])


def rows_answer_metrics(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor,
    seq_len: int,
    batch: int,
    ctx: TPLike,
    *,
    vocab_size: int,
) -> dict[str, torch.Tensor]:
    """:func:`answer_metrics` from the logits of :func:`labelled_rows` ``(n, V/tp)``; ``rows``
    are those rows' flat indices and ``seq_len`` the microbatch's ``t``."""
    with torch.no_grad():
        pred = tp_argmax(logits, ctx, vocab_size)  # (n,)
        return _sums(pred == targets, torch.div(rows, seq_len, rounding_mode="floor"), batch)


class AnswerObjective(NextTokenObjective):
    """The next-token loss over the supervised (answer) tokens; the teacher-forced answer and
    token accuracies. With ``--logits labelled`` the last stage returns hidden states and the
    loss applies the head to the labelled rows only (found on the host)."""

    metric_sums = ("token_correct", "tokens", "answers_correct", "answers")
    metrics = (
        MetricSpec("answer_accuracy", "answers_correct", "answers", "acc"),
        MetricSpec("token_accuracy", "token_correct", "tokens", "tok"),
    )

    def labelled_target(self, run: Run, mb: Microbatch) -> Any:
        rows, targets = labelled_rows(mb["labels"])
        b, t = mb["labels"].shape
        return rows, targets, t, b

    def loss(self, chunk, output, target, ctx, run: Run):
        vocab = chunk.config.vocab_size
        if run.logits == "labelled":
            rows, row_targets, t, b = target
            logits = self.labelled_logits(chunk, output, rows)  # (n, V/tp)
            ce = rows_loss(logits, row_targets, ctx, vocab_size=vocab)
            m = rows_answer_metrics(logits, row_targets, rows, t, b, ctx, vocab_size=vocab)
        else:
            ce = llava_loss(output, target, ctx, vocab_size=vocab, reduction="sum")
            m = answer_metrics(output, target, ctx, vocab_size=vocab)
        return ce, torch.stack([m[k] for k in self.metric_sums])

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

from typing import Any

import torch

from parallax.families.openvla.action_tokenizer import ActionTokenizer
from parallax.models.next_token import (
    expand_labels,
    labelled_rows,
    loss_token_count,
    rows_loss,
    vla_loss,
)
from parallax.recipe import MetricSpec, Microbatch, NextTokenObjective
from parallax.run import Run
from parallax.tensor.layers import TPLike
from parallax.tensor.loss import tp_argmax

__all__ = [
    "action_metrics",
    "expand_labels",
    "labelled_rows",
    "loss_token_count",
    "rows_action_metrics",
    "rows_loss",
    "vla_loss",
]


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


class ActionTokenObjective(NextTokenObjective):
    """OpenVLA's next-token loss over the labelled tokens (the 7 action tokens and EOS of each
    sample); its action-token accuracy and the L1 error of the decoded actions. With
    ``--logits labelled`` the last stage returns hidden states and the loss applies the final
    norm and lm_head to the labelled rows only."""

    metric_sums = ("action_correct", "action_l1_sum", "action_tokens")
    metrics = (
        MetricSpec("action_accuracy", "action_correct", "action_tokens", "acc"),
        MetricSpec("l1", "action_l1_sum", "action_tokens", "l1"),
    )

    def labelled_target(self, run: Run, mb: Microbatch) -> Any:
        return labelled_rows(mb["labels"], run.model_config.num_patches)

    def loss(self, chunk, output, target, ctx, run: Run):
        mc = chunk.config
        vocab, tok = mc.text.vocab_size, chunk.action_tokenizer
        if run.logits == "labelled":
            rows, row_targets = target
            logits = self.labelled_logits(chunk, output, rows)  # (n, V/tp)
            ce = rows_loss(logits, row_targets, ctx, vocab_size=vocab)
            m = rows_action_metrics(
                logits, row_targets, ctx, vocab_size=vocab, action_tokenizer=tok
            )
        else:
            p = mc.num_patches
            ce = vla_loss(output, target, ctx, num_patches=p, vocab_size=vocab, reduction="sum")
            m = action_metrics(
                output, target, ctx, num_patches=p, vocab_size=vocab, action_tokenizer=tok
            )
        return ce, torch.stack([m[k] for k in self.metric_sums])

"""A recipe's objective: what a step minimises and which metrics it reports.

Two kinds. :class:`TokenObjective` (``"tokens"``): a loss per microbatch on the last stage,
summed over supervised units and normalised by the units of the whole global batch, which the
Trainer counts (``loss_units``, ``loss_target``, ``loss``); any pipeline runs it.
:class:`StepObjective` (``"step"``): the loss needs every microbatch of the step (a
contrastive loss over the dp group): ``forward_backward`` and ``evaluate_step`` run the step
themselves, with pp = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.models.next_token import loss_token_count
from parallax.recipe.model_side import Microbatch
from parallax.run import Run


@dataclass(frozen=True)
class MetricSpec:
    """One metric reported per step: ``value = sums[numerator] / max(sums[denominator], 1)``
    over the global batch, printed as ``label`` with ``fmt`` on the progress line."""

    key: str  # the metrics.jsonl key
    numerator: str
    denominator: str
    label: str
    fmt: str = ".3f"


class Objective:
    """What both kinds share: the metrics and the backward passes of a step."""

    kind = ""
    # names of the metric sums the loss returns, besides the loss sum itself, reduced over dp
    metric_sums: tuple[str, ...] = ()
    metrics: tuple[MetricSpec, ...] = ()
    # the evaluation's own metric sums and metrics (``evaluate_step``), when they differ from
    # the training step's; ``None``: the same as ``metric_sums`` and ``metrics``
    eval_metric_sums: tuple[str, ...] | None = None
    eval_metrics: tuple[MetricSpec, ...] | None = None

    def loss_units(self, mb: Microbatch) -> int:
        """How many supervised units (tokens, pairs) this microbatch's loss sums over (host)."""
        raise NotImplementedError

    def sampled_sums(
        self, chunks: Sequence[nn.Module], microbatches: Sequence[Microbatch], ctx, run: Run
    ) -> torch.Tensor | None:
        """An evaluation's sums of what the model generates from this rank's microbatches (a
        flow-matching policy samples its chunks), past the loss's in ``eval_metric_sums``: a
        float64 vector, the same on every tp and pp rank (the trainer sums it over dp), or
        ``None`` where the objective generates nothing. Collective over tp and pp."""
        return None

    def backward_passes(self, num_microbatches: int) -> int:
        """Backward passes one step runs per parameter (ZeRO reduces a bucket after the last
        one): one per microbatch."""
        return num_microbatches


class TokenObjective(Objective):
    """A loss per microbatch on the last stage (see the module docstring)."""

    kind = "tokens"

    def loss_target(self, run: Run, mb: Microbatch) -> Any:
        """What the last stage's loss needs besides the model output (host tensors)."""
        raise NotImplementedError

    def loss(
        self, chunk: nn.Module, output: Any, target: Any, ctx: ParallelContext, run: Run
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of unit losses, metric sums)`` of one microbatch on the last stage; the sums
        are a float32 vector in the order of ``metric_sums``."""
        raise NotImplementedError


class NextTokenObjective(TokenObjective):
    """A next-token loss over the labelled tokens of ``mb["labels"]`` (-100 elsewhere): the
    units are those tokens; with ``--logits labelled`` the last stage hands on hidden states
    and the loss applies the head to the labelled rows only."""

    def loss_units(self, mb: Microbatch) -> int:
        return int(loss_token_count(mb["labels"]))

    def loss_target(self, run: Run, mb: Microbatch) -> Any:
        """The labels, or with ``--logits labelled`` the family's :meth:`labelled_target`."""
        return mb["labels"] if run.logits != "labelled" else self.labelled_target(run, mb)

    def labelled_target(self, run: Run, mb: Microbatch) -> Any:
        """The labelled rows and their targets, found on the host (``--logits labelled``)."""
        raise NotImplementedError

    @staticmethod
    def labelled_logits(chunk: nn.Module, output: torch.Tensor, rows: torch.Tensor):
        """The head over the labelled ``rows`` (flat indices) of the last stage's hidden
        states ``output (b, t, h)``: ``(n, V/tp)``."""
        hidden = output.flatten(0, 1).index_select(0, rows)  # (n, h), the same on every tp
        return chunk.head(hidden)


class StepObjective(Objective):
    """The recipe runs the step's forwards and backwards (pp = 1)."""

    kind = "step"

    def forward_backward(
        self, chunks: Sequence[nn.Module], microbatches: Sequence[Microbatch], ctx, run: Run
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every forward and backward of the step (pp = 1) and return ``(loss, metric sums)``:
        the global batch's loss (the same on every rank) and sums over the global batch. The
        gradients left in ``.grad`` are this rank's share: their mean over dp (what ZeRO
        takes) must be the gradient of that loss."""
        raise NotImplementedError

    def evaluate_step(
        self, chunks: Sequence[nn.Module], microbatches: Sequence[Microbatch], ctx, run: Run
    ) -> torch.Tensor:
        """``[loss, *metric sums]`` of an evaluation batch, forward only."""
        raise NotImplementedError


def metric_values(
    objective: Objective, sums: Sequence[float], evaluation: bool = False
) -> dict[str, float]:
    """The objective's metrics from the step's sums (``sums[0]`` is the loss sum); with
    ``evaluation`` those of ``evaluate_step`` (``eval_metric_sums``) where it has them."""
    names, metrics = objective.metric_sums, objective.metrics
    if evaluation and objective.eval_metric_sums is not None:
        names, metrics = objective.eval_metric_sums, objective.eval_metrics or ()
    by_name = dict(zip(names, sums[1:]))
    return {m.key: by_name[m.numerator] / max(by_name[m.denominator], 1.0) for m in metrics}

"""Model families as recipes: everything the one Trainer needs to know about a model.

The Trainer, the CLI, ``--dry-run``, checkpoints and the benchmarks own what every family shares
(the layout, the pipeline schedule, ZeRO, parameter groups and freezing, the learning-rate
schedule, checkpoints, metrics and the step loop). A :class:`Recipe` tells them the rest, in
three groups; a family defines what :data:`REQUIRED` lists for its objective and inherits every
other hook (:mod:`parallax.recipe.defaults`):

- **model**: ``resolve`` (a preset or checkpoint -> config), ``blocks`` (the ordered pipeline
  blocks with their costs) and ``build`` (this rank's chunk for a block range, from the
  layout-free init or a checkpoint, each rank reading only its slice);
- **data**: ``dataset`` (what ``--data`` names), ``collator`` (raw samples -> a microbatch dict
  of host tensors), ``stage_inputs`` (what the first stage takes) and ``stage_metas`` (what later
  stages receive);
- **objective**: ``"tokens"`` (a loss per microbatch on the last stage, summed over supervised
  units and normalised by the units of the whole global batch, which the Trainer counts:
  ``loss_units``, ``loss_target``, ``loss``) or ``"step"`` (the loss needs every microbatch of
  the step, e.g. a contrastive loss over the dp group: ``forward_backward`` and
  ``evaluate_step`` run the step themselves, with pp = 1).

Every method that takes ``cfg`` receives the resolved run (:class:`parallax.train.run.Run`): the
options with the family's defaults filled in, ``cfg.model_config`` and ``cfg.checkpoint``.
Recipes are registered by name (:func:`parallax.register`, :mod:`parallax.recipe.registry`);
nothing in ``parallax.train`` names a family. ``examples/custom_recipe.py`` is the minimum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.models.stages import StageBlock
from parallax.pipeline import TensorMeta
from parallax.recipe.defaults import Microbatch, RecipeDefaults, batch_args

__all__ = [
    "REQUIRED",
    "MetricSpec",
    "Microbatch",
    "ModelSpec",
    "Recipe",
    "batch_args",
    "metric_values",
    "missing_methods",
    "whole_model",
]


@dataclass(frozen=True)
class MetricSpec:
    """One metric reported per step: ``value = sums[numerator] / max(sums[denominator], 1)``
    over the global batch, printed as ``label`` with ``fmt`` on the progress line."""

    key: str  # the metrics.jsonl key
    numerator: str
    denominator: str
    label: str
    fmt: str = ".3f"


@dataclass
class ModelSpec:
    """What ``--model`` resolved to: the family's config and the checkpoint to read, if any."""

    config: Any
    checkpoint: Path | None = None


class Recipe(RecipeDefaults):
    """A model family; see the module docstring. Class attributes are the family's constants."""

    name: str = ""  # the family, as --model FAMILY:SPEC and checkpoints name it
    objective: str = "tokens"  # "tokens" or "step"
    # names of the metric sums ``loss()`` returns, besides the loss sum itself, reduced over dp
    metric_sums: tuple[str, ...] = ()
    metrics: tuple[MetricSpec, ...] = ()
    # ``--freeze-<alias>`` and ``--freeze <alias>`` stand for these globs of global names
    freeze_aliases: Mapping[str, tuple[str, ...]] = {}
    # keys every microbatch dict must hold (checked on every rank before a step)
    input_keys: tuple[str, ...] = ()
    # the block that must open the first stage (pin_first) when a pipeline splits the model
    pin_first: int = 1
    # last name parts of the linears ``--lora-targets all-linear`` leaves alone (output heads)
    lora_exclude: tuple[str, ...] = ("lm_head",)
    # the evaluation's own metric sums and metrics (``evaluate_step``), when they differ from
    # the training step's; ``None``: the same as ``metric_sums`` and ``metrics``
    eval_metric_sums: tuple[str, ...] | None = None
    eval_metrics: tuple[MetricSpec, ...] | None = None
    # whether the collator rounds its text up to ``--pad-to-multiple-of`` (refused elsewhere)
    pads_text: bool = False

    # -- model: what a family must say ------------------------------------------------------------
    def presets(self) -> Sequence[str]:
        """Preset names ``--model`` accepts."""
        return ()

    def resolve(self, spec: str) -> ModelSpec:
        """A preset name or a checkpoint directory -> the config (and the checkpoint)."""
        raise NotImplementedError

    def blocks(self, config: Any) -> list[StageBlock]:
        """The ordered pipeline blocks, each with its forward FLOPs per sample as cost."""
        raise NotImplementedError

    def build(
        self,
        config: Any,
        blocks: range,
        ctx: ParallelContext,
        *,
        cfg,
        dtype: torch.dtype,
        device: torch.device | str,
        checkpoint: Path | None,
    ) -> nn.Module:
        """This rank's chunk of ``blocks``: from the layout-free init of ``cfg.seed`` or from
        ``checkpoint`` (reading only this rank's slices), with the run's options (activation
        checkpointing) applied; on the ``meta`` device, shapes only (no init, no reads).
        Parameter names must be global and layout-free."""
        raise NotImplementedError

    # -- data --------------------------------------------------------------------------------------
    def dataset(self, spec: str, cfg) -> Any:
        """The dataset ``--data spec`` names (random access: ``len`` and ``[i]``)."""
        raise NotImplementedError

    def collator(
        self, config: Any, dataset: Any, checkpoint: Path | None
    ) -> Callable[[Sequence[Any]], Microbatch]:
        """A function from a list of raw samples to one microbatch of host tensors."""
        raise NotImplementedError

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        """What the first stage's forward takes, in order."""
        raise NotImplementedError

    def stage_metas(self, config: Any, mb: Microbatch, dtype: torch.dtype) -> list[TensorMeta]:
        """What every later stage receives for this microbatch (read from host shapes, the same
        on every rank, so the pipeline needs no metadata round trip)."""
        raise NotImplementedError

    # -- objective "tokens": a loss per microbatch on the last stage -------------------------------
    def loss_units(self, mb: Microbatch) -> int:
        """How many supervised units (tokens) this microbatch's loss sums over (host)."""
        raise NotImplementedError

    def loss_target(self, config: Any, mb: Microbatch, cfg) -> Any:
        """What the last stage's loss needs besides the model output (host tensors)."""
        raise NotImplementedError

    def loss(
        self, chunk: nn.Module, output: Any, target: Any, ctx: ParallelContext, cfg
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of unit losses, metric sums)`` of one microbatch on the last stage; the sums
        are a float32 vector in the order of ``metric_sums``."""
        raise NotImplementedError

    # -- objective "step": the recipe runs the step's forwards and backwards (pp = 1) -------------
    def forward_backward(
        self, chunks: Sequence[nn.Module], microbatches: Sequence[Microbatch], ctx, cfg
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every forward and backward of the step (pp = 1) and return ``(loss, metric sums)``:
        the global batch's loss (the same on every rank) and sums over the global batch. The
        gradients left in ``.grad`` are this rank's share: their mean over dp (what ZeRO-1
        takes) must be the gradient of that loss."""
        raise NotImplementedError

    def evaluate_step(
        self, chunks: Sequence[nn.Module], microbatches: Sequence[Microbatch], ctx, cfg
    ) -> torch.Tensor:
        """``[loss, *metric sums]`` of an evaluation batch, forward only, for a ``"step"``
        recipe (the Trainer runs the pipeline forward for ``"tokens"`` recipes)."""
        raise NotImplementedError


# what a family must define, by objective (the rest it inherits from RecipeDefaults)
REQUIRED = {
    "tokens": (
        "resolve",
        "blocks",
        "build",
        "dataset",
        "collator",
        "stage_inputs",
        "stage_metas",
        "loss_units",
        "loss_target",
        "loss",
    ),
    "step": (
        "resolve",
        "blocks",
        "build",
        "dataset",
        "collator",
        "forward_backward",
    ),
}


def missing_methods(recipe: Recipe) -> list[str]:
    """The methods ``recipe`` must define for its objective and does not."""
    if recipe.objective not in REQUIRED:
        return [f"objective {recipe.objective!r} (one of {', '.join(REQUIRED)})"]
    cls = type(recipe)
    return [n for n in REQUIRED[recipe.objective] if getattr(cls, n) is getattr(Recipe, n)]


def whole_model(recipe: Recipe, config: Any, cfg, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The whole model on the meta device at tp = 1: every global name and shape, no memory
    and no collective (the same on every rank)."""
    return recipe.build(
        config,
        range(len(recipe.blocks(config))),
        ParallelContext.local(device="meta"),
        cfg=cfg,
        dtype=dtype,
        device="meta",
        checkpoint=None,
    )


def metric_values(
    recipe: Recipe, sums: Sequence[float], evaluation: bool = False
) -> dict[str, float]:
    """The recipe's metrics from the step's sums (``sums[0]`` is the loss sum); with
    ``evaluation`` those of ``evaluate_step`` (``eval_metric_sums``) where the recipe has them."""
    names, metrics = recipe.metric_sums, recipe.metrics
    if evaluation and recipe.eval_metric_sums is not None:
        names, metrics = recipe.eval_metric_sums, recipe.eval_metrics or ()
    by_name = dict(zip(names, sums[1:]))
    return {m.key: by_name[m.numerator] / max(by_name[m.denominator], 1.0) for m in metrics}

"""Model families as recipes: everything the one Trainer needs to know about a model.

The Trainer, the CLI, ``--dry-run``, checkpoints and the benchmarks own what every family shares
(the layout, the pipeline schedule, ZeRO-1, parameter groups and freezing, the learning-rate
schedule, checkpoints, metrics and the step loop). A :class:`Recipe` tells them the rest:

- **model**: its presets and which checkpoints it reads (by their ``config.json``), the ordered
  pipeline blocks with their costs, and how to build this rank's chunk for a block range
  (layout-free init or a checkpoint, each rank reading only its slice);
- **data**: the dataset a ``--data`` spec names, the loader that orders and reads it (random
  access by default, or streamed), how raw samples become a microbatch (a dict of
  host tensors), what the first stage takes and what later stages receive;
- **objective**: ``"tokens"`` (a next-token VLM: a loss per microbatch on the last stage, summed
  over supervised units and normalised by the units of the whole global batch, which the Trainer
  counts) or ``"step"`` (the loss needs every microbatch of the step, e.g. a contrastive loss over
  the dp group: the recipe runs the step's forwards and backwards itself, with pp = 1);
- **reporting and export**: metric sums and what they mean, model FLOPs, tokens, the HF export.

Recipes are found by name in :mod:`parallax.recipe.registry`; nothing else in ``parallax.train``
names a family. Subclass :class:`Recipe` and override what differs: the defaults are those of a
next-token model whose microbatches carry ``labels``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.dims import ParallelDims
from parallax.models.stages import StageBlock
from parallax.pipeline import TensorMeta

Microbatch = dict[str, Any]  # host tensors (and anything else the recipe puts there)


def batch_args(cfg, ctx: ParallelContext) -> dict[str, int]:
    """The batch sizes, this rank's dp share and the seed: what every loader of a run takes."""
    return dict(
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        seed=cfg.seed,
    )


def fill_lr_defaults(recipe: Recipe, name: str, cfg) -> None:
    """``--lr`` and ``--lr-groups`` left unset take the family's defaults for ``name`` (LoRA's
    rate with ``--finetune lora``): the same for a run and for its ``--dry-run``."""
    if cfg.lr is None:
        lora = cfg.finetune == "lora"
        cfg.lr = recipe.default_lora_lr(name) if lora else recipe.default_lr(name)
    if cfg.lr_groups is None:
        cfg.lr_groups = recipe.default_lr_groups(name, cfg.lr)


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


class Recipe:
    """A model family; see the module docstring. Class attributes are the family's constants."""

    name: str = ""
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

    # -- model ---------------------------------------------------------------------------------
    def presets(self) -> Sequence[str]:
        """Preset names ``--model`` accepts."""
        return ()

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        """Whether a checkpoint with this ``config.json`` belongs to the family."""
        return False

    def resolve(self, spec: str) -> ModelSpec:
        """A preset name or a checkpoint directory -> the config (and the checkpoint)."""
        raise NotImplementedError

    def default_lr(self, spec: str) -> float:
        """The peak learning rate when ``--lr`` is not given."""
        return 2e-5

    def default_lr_groups(self, spec: str, lr: float) -> Any:
        """The ``--lr-groups`` of a run that gives none (``None``: every parameter at ``lr``)."""
        return None

    def default_lora_lr(self, spec: str) -> float:
        """The peak learning rate of ``--finetune lora`` when ``--lr`` is not given: OpenVLA's
        LoRA recipe (AdamW 5e-4, constant)."""
        return 5e-4

    def fully_trained(self, cfg) -> tuple[str, ...]:
        """Module globs of this run's new modules that train whole beside LoRA's adapters
        (``--train`` without being asked; OpenVLA-OFT's head) and that the family's export
        writes apart from the PEFT adapter; none by default."""
        return ()

    def configure(self, config: Any, cfg) -> Any:
        """The model config with the run's options applied (e.g. fused projections)."""
        return config

    def check_layout(self, config: Any, cfg, dims: ParallelDims) -> None:
        """Raise ``ValueError`` for a layout the family cannot run (same verdict on every rank:
        it sees only the config and the dims)."""

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

    def export(self, chunk: nn.Module, path: Path, statistics: Mapping | None) -> None:
        """Write the chunk's part of the HF checkpoint (collective over the whole world)."""
        raise ValueError(f"--export-hf: the {self.name} recipe has no export")

    # -- data ----------------------------------------------------------------------------------
    def dataset(self, spec: str, cfg) -> Any:
        """The dataset ``--data spec`` names (random access: ``len`` and ``[i]``)."""
        raise NotImplementedError

    def eval_dataset(self, spec: str | None, cfg) -> Any:
        """The held-out split for ``--eval-interval``: ``--eval-data spec``, or with ``None`` the
        family's own held-out part of ``cfg.data`` (a ``ValueError`` when it has none)."""
        if spec is None:
            raise ValueError("--eval-interval: give the held-out data with --eval-data")
        return self.dataset(spec, cfg)

    def loader(self, dataset: Any, cfg, ctx: ParallelContext) -> Any:
        """What yields this dp rank's raw samples per step: ``next_batch()`` -> a list of
        ``num_microbatches`` lists of samples, and a JSON ``state_dict()`` /
        ``load_state_dict()`` (saved in checkpoints; a resume at any layout continues it).
        The sample order of each global batch must depend on ``cfg.seed`` and the position
        only, never on dp. Default: the random-access :class:`~parallax.data.BatchLoader`;
        a family whose data streams returns its own (``close()`` is called at the end)."""
        from parallax.data import BatchLoader

        return BatchLoader(
            dataset,
            **batch_args(cfg, ctx),
        )

    def input_problem(self, config: Any, mb: Microbatch, cfg) -> str | None:
        """What is wrong with one microbatch (shapes, sizes), or ``None``: checked on every rank
        before a training step's first collective, so a bad one raises on all ranks."""
        return None

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

    # -- objective "tokens" --------------------------------------------------------------------
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

    # -- objective "step" ----------------------------------------------------------------------
    def backward_passes(self, num_microbatches: int) -> int:
        """Backward passes one step runs per parameter (ZeRO-1 reduces a bucket after the last
        one): one per microbatch for a pipeline, what ``forward_backward`` runs otherwise."""
        return num_microbatches

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

    # -- reporting -----------------------------------------------------------------------------
    def flops(self, config: Any, microbatches: Sequence[Microbatch], cfg) -> float:
        """Model FLOPs of these microbatches' training step (formula in the family's docs)."""
        return 0.0

    def activation_bytes(
        self, config: Any, block_names: Sequence[str], micro_batch_size: int, tp: int
    ) -> float:
        """Estimated activation bytes at 16-bit that one microbatch in flight keeps on a rank
        holding ``block_names`` (for ``--dry-run``; 0 when the family gives no estimate)."""
        return 0.0

    def tokens(self, config: Any, microbatches: Sequence[Microbatch]) -> int:
        """Tokens these microbatches process (for tokens/s): image and text tokens."""
        return 0


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

"""The SigLIP/CLIP family's model and data sides (:mod:`parallax.families.siglip.recipe`
composes them with the contrastive objective)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.data import PairLoader
from parallax.families.siglip.batches import PairCollator
from parallax.families.siglip.config import SiglipConfig
from parallax.families.siglip.data import IndexedPairs, open_pairs
from parallax.families.siglip.estimate import block_estimates
from parallax.families.siglip.flops import flops_per_sample, text_flops, vision_flops
from parallax.families.siglip.model import Siglip
from parallax.models.estimate import BlockEstimate
from parallax.models.stages import StageBlock
from parallax.recipe import DataSide, Microbatch, ModelSide, ModelSpec, batch_args
from parallax.recipe.model_side import init_seed, preset_or_checkpoint
from parallax.run import Run

log = logging.getLogger(__name__)

FAMILY_PRESETS = (
    "siglip-tiny",
    "siglip-base-patch16-224",
    "siglip-large-patch16-256",
    "clip-vit-large-patch14",
    "clip-tiny",
)
DEFAULT_LR = {"siglip-tiny": 1e-3, "clip-tiny": 1e-3}
DEFAULT_LR_LARGE = 1e-4


class SiglipModel(ModelSide):
    """The two towers, one pipeline block (pp = 1)."""

    freeze_aliases = {"vision": ("vision.*",), "text": ("text.*",)}
    pin_first = 0

    def presets(self) -> Sequence[str]:
        return FAMILY_PRESETS

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        return config_json.get("model_type") in ("siglip", "clip")

    def resolve(self, spec: str) -> ModelSpec:
        where = "a SigLIP/CLIP checkpoint directory"
        return preset_or_checkpoint(
            spec, SiglipConfig, "a dual-encoder preset", FAMILY_PRESETS, where
        )

    def default_lr(self, spec: str) -> float:
        return DEFAULT_LR.get(spec, DEFAULT_LR_LARGE)

    def check_layout(self, run: Run, dims) -> None:
        config: SiglipConfig = run.model_config
        if dims.pp > 1:
            raise ValueError(
                f"--pp {dims.pp}: dual encoders (SigLIP, CLIP) do not support pipeline "
                "parallelism: the two towers are parallel branches, not a chain; use --tp and "
                "--dp with --pp 1"
            )
        for name, tower in (("vision", config.vision), ("text", config.text)):
            if tower.num_heads % dims.tp:
                raise ValueError(
                    f"--tp {dims.tp} does not divide the {name} tower's {tower.num_heads} "
                    f"attention heads (width {tower.width})"
                )
        _log_negatives(run, dims)

    def blocks(self, config: SiglipConfig) -> list[StageBlock]:
        return [StageBlock("towers", vision_flops(config) + text_flops(config))]

    def build(self, run, blocks, ctx, *, dtype, device, checkpoint) -> nn.Module:
        ac = run.checkpointing
        if checkpoint is not None and torch.device(device).type != "meta":
            return Siglip.from_pretrained(
                checkpoint, ctx, dtype=dtype, device=device, activation_checkpointing=ac
            )
        return Siglip(
            run.model_config, ctx, dtype=dtype, device=device, activation_checkpointing=ac,
            seed=init_seed(run, device),
        )  # fmt: skip

    def export(self, run: Run, chunk: Siglip, path: Path, statistics: Mapping | None) -> None:
        chunk.save_pretrained(path)

    def flops(self, run: Run, microbatches: Sequence[Microbatch], model=None) -> float:
        """:func:`~parallax.families.siglip.flops.flops_per_sample`: 3 x (both towers' forward
        + the loss's logits against the global batch) per pair; GradCache's extra forward not
        counted."""
        n = sum(mb["pixel_values"].shape[0] for mb in microbatches)
        return n * flops_per_sample(run.model_config, run.global_batch_size)

    def block_estimates(self, run: Run) -> list[BlockEstimate]:
        """:func:`parallax.families.siglip.estimate.block_estimates`; GradCache keeps one
        microbatch's activations at a time, whatever the microbatches of a step."""
        return block_estimates(run.model_config, run)

    def tokens(self, run: Run, microbatches: Sequence[Microbatch]) -> int:
        patches = run.model_config.vision.num_patches
        return sum(
            mb["input_ids"].numel() + mb["input_ids"].shape[0] * patches for mb in microbatches
        )


def _log_negatives(run: Run, dims) -> None:
    """Say which negatives a step scores (every pair of the global batch)."""
    unit = run.micro_batch_size * dims.dp
    if run.global_batch_size % unit:
        return  # the trainer says why
    log.info(
        "negatives: every step scores each of its %d images against all %d captions of "
        "the global batch (dp %d x %d microbatch(es) of %d; embeddings cached across "
        "microbatches), %s loss",
        run.global_batch_size,
        run.global_batch_size,
        dims.dp,
        run.global_batch_size // unit,
        run.micro_batch_size,
        run.model_config.loss,
    )


class SiglipData(DataSide):
    """Image-text pairs (folders, WebDataset tar shards, the synthetic task)."""

    input_keys = ("pixel_values", "input_ids")

    def dataset(self, spec: str, run: Run) -> Any:
        return open_pairs(spec, run.model_config.image_size, run.seed)

    def eval_dataset(self, spec: str | None, run: Run) -> Any:
        """``--eval-data``, or for the synthetic task its ``eval`` split (pairs drawn apart from
        the training ones), ``--eval-batches`` global batches of it."""
        if spec is None:
            if not run.data.startswith("synthetic"):
                raise ValueError(
                    "--eval-interval: give the held-out pairs with --eval-data (a folder or tar "
                    "shards)"
                )
            spec = f"synthetic:{run.eval_batches * run.global_batch_size}"
        size = run.model_config.image_size
        return IndexedPairs(open_pairs(spec, size, run.seed, split="eval"))

    def loader(self, dataset: Any, run: Run, ctx) -> Any:
        return PairLoader(dataset, **batch_args(run, ctx))

    def collator(self, run: Run, dataset: Any):
        return PairCollator(run.model_config, dataset, run.checkpoint)

    def input_problem(self, run: Run, mb: Microbatch) -> str | None:
        """Shapes that would fail inside the towers or unbalance the ring (all ranks exchange
        blocks of ``--micro-batch-size`` rows)."""
        config: SiglipConfig = run.model_config
        px, ids, s = mb["pixel_values"], mb["input_ids"], config.image_size
        m, limit = run.micro_batch_size, config.text.max_length
        if px.dim() != 4 or tuple(px.shape[1:]) != (3, s, s):
            return (
                f"pixel_values must be (b, 3, {s}, {s}) for this model, got {tuple(px.shape)} "
                "(the collator resizes images; preprocess them the same way)"
            )
        if ids.dim() != 2 or ids.shape[1] > limit:
            return (
                f"input_ids must be (b, t) with t <= {limit} (the text tower's maximum length), "
                f"got {tuple(ids.shape)}: truncate the captions"
            )
        if px.shape[0] != m or ids.shape[0] != m:
            return (
                f"{px.shape[0]} images and {ids.shape[0]} captions, but every microbatch holds "
                f"--micro-batch-size {m} pairs"
            )
        return None

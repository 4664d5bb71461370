"""SigLIP and CLIP dual encoders as a recipe: a ``"step"`` objective whose loss sees the whole
global batch.

Presets ``siglip-tiny``, ``siglip-base-patch16-224``, ``siglip-large-patch16-256`` (sigmoid
loss) and ``clip-vit-large-patch14`` (and ``clip-tiny``; softmax loss), or a Hugging Face
``SiglipModel`` / ``CLIPModel`` checkpoint directory (found by its ``config.json``).

**Which negatives a step uses: all of them.** The loss of a step is the single-process
contrastive loss over the *global batch* (``--global-batch-size`` pairs: every dp rank's every
microbatch), each image against every caption of it. Across dp the losses of
:mod:`parallax.tensor.contrastive` exchange features (sigmoid: the chunked ring, memory
``O(local b^2)``; softmax: an all-gather with local rows); across microbatches
:func:`parallax.families.siglip.step.contrastive_step` caches the embeddings (GradCache): it
embeds every microbatch without autograd, takes the loss and its gradient with respect to
every embedding, then runs each microbatch's forward again and backpropagates its slice. So
gradient accumulation never shrinks the set of negatives; its price is one more forward per
microbatch when there are several (not counted in the FLOPs, like recomputation).

Layouts: tp shards both towers, dp with ZeRO-1 (``logit_scale`` and ``logit_bias`` are 1-element
parameters in the flat buffers); **pp > 1 is refused**: the towers are two parallel branches, not
a chain, and the largest preset (652M parameters) fits one GPU.

Training metrics: the temperature ``t = exp(logit_scale)``, the bias, and the shares of
captions truncated and images resized (:mod:`parallax.families.siglip.data`). Evaluation
(``--eval-interval``): the loss, zero-shot top-1/top-5 accuracy (one class-name prompt per
class; the synthetic task's 18 colour-shape classes, or 0 for data without labels) and
image->text / text->image recall@1/5/10, where each evaluation batch's ``--global-batch-size``
pairs are the candidates (the same pool the loss contrasts), summed over ``--eval-batches``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax import comm
from parallax.data import PairLoader
from parallax.families.siglip.config import PRESETS, SiglipConfig
from parallax.families.siglip.data import IndexedPairs, PairCollator, open_pairs
from parallax.families.siglip.estimate import block_estimates
from parallax.families.siglip.evaluate import evaluate_batch
from parallax.families.siglip.model import Siglip
from parallax.families.siglip.step import contrastive_step
from parallax.models.estimate import BlockEstimate
from parallax.models.stages import StageBlock
from parallax.recipe.protocol import MetricSpec, Microbatch, ModelSpec, Recipe, batch_args

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
KS = (1, 5, 10)


class SiglipRecipe(Recipe):
    name = "siglip"
    objective = "step"
    metric_sums = ("scale_sum", "bias_sum", "truncated", "resized", "pairs")
    metrics = (
        MetricSpec("temperature", "scale_sum", "pairs", "t", ".2f"),
        MetricSpec("logit_bias", "bias_sum", "pairs", "b", ".2f"),
        MetricSpec("truncated", "truncated", "pairs", "trunc", ".2f"),
        MetricSpec("resized", "resized", "pairs", "resized", ".2f"),
    )
    eval_metric_sums = (
        *(f"{d}_r{k}" for d in ("i2t", "t2i") for k in KS),
        "queries",
        "zs_top1",
        "zs_top5",
        "zs_images",
    )
    eval_metrics = (
        *(
            MetricSpec(f"{name}_r@{k}", f"{d}_r{k}", "queries", f"{d} r@{k}")
            for d, name in (("i2t", "image_to_text"), ("t2i", "text_to_image"))
            for k in KS
        ),
        MetricSpec("zero_shot_top1", "zs_top1", "zs_images", "zs@1"),
        MetricSpec("zero_shot_top5", "zs_top5", "zs_images", "zs@5"),
    )
    freeze_aliases = {"vision": ("vision.*",), "text": ("text.*",)}
    input_keys = ("pixel_values", "input_ids")
    pin_first = 0

    # -- model ---------------------------------------------------------------------------------
    def presets(self) -> Sequence[str]:
        return FAMILY_PRESETS

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        return config_json.get("model_type") in ("siglip", "clip")

    def resolve(self, spec: str) -> ModelSpec:
        if spec in PRESETS:
            return ModelSpec(SiglipConfig.preset(spec))
        path = Path(spec)
        if path.is_dir() and (path / "config.json").is_file():
            return ModelSpec(SiglipConfig.from_pretrained(path), path)
        raise ValueError(
            f"--model {spec!r} is neither a dual-encoder preset ({', '.join(FAMILY_PRESETS)}) "
            "nor a SigLIP/CLIP checkpoint directory with a config.json"
        )

    def default_lr(self, spec: str) -> float:
        return DEFAULT_LR.get(spec, DEFAULT_LR_LARGE)

    def check_layout(self, config: SiglipConfig, cfg, dims) -> None:
        if dims.pp > 1:
            raise ValueError(
                f"--pp {dims.pp}: dual encoders (SigLIP, CLIP) do not support pipeline "
                "parallelism: the two towers are parallel branches, not a chain; use --tp and "
                "--dp with --pp 1"
            )
        for name, width in (("vision", config.vision.width), ("text", config.text.width)):
            heads = (config.vision if name == "vision" else config.text).num_heads
            if heads % dims.tp:
                raise ValueError(
                    f"--tp {dims.tp} does not divide the {name} tower's {heads} attention heads "
                    f"(width {width})"
                )
        unit = cfg.micro_batch_size * dims.dp
        if cfg.global_batch_size % unit:
            return  # the trainer says why
        m = cfg.global_batch_size // unit
        log.info(
            "negatives: every step scores each of its %d images against all %d captions of "
            "the global batch (dp %d x %d microbatch(es) of %d; embeddings cached across "
            "microbatches), %s loss",
            cfg.global_batch_size,
            cfg.global_batch_size,
            dims.dp,
            m,
            cfg.micro_batch_size,
            config.loss,
        )

    def blocks(self, config: SiglipConfig) -> list[StageBlock]:
        return [StageBlock("towers", config.vision_flops() + config.text_flops())]

    def build(self, config, blocks, ctx, *, cfg, dtype, device, checkpoint) -> nn.Module:
        ac = cfg.checkpointing
        if checkpoint is not None and torch.device(device).type != "meta":
            return Siglip.from_pretrained(
                checkpoint, ctx, dtype=dtype, device=device, activation_checkpointing=ac
            )
        seed = None if torch.device(device).type == "meta" else cfg.seed  # shapes only
        return Siglip(
            config, ctx, dtype=dtype, device=device, activation_checkpointing=ac, seed=seed
        )

    def export(self, chunk: Siglip, path: Path, statistics: Mapping | None) -> None:
        chunk.save_pretrained(path)

    # -- data ----------------------------------------------------------------------------------
    def _image_size(self, cfg) -> int:
        family, sep, rest = cfg.model.partition(":")
        spec = rest if sep and family == self.name else cfg.model
        return self.resolve(spec).config.image_size

    def dataset(self, spec: str, cfg) -> Any:

        return open_pairs(spec, self._image_size(cfg), cfg.seed)

    def eval_dataset(self, spec: str | None, cfg) -> Any:
        """``--eval-data``, or for the synthetic task its ``eval`` split (pairs drawn apart from
        the training ones), ``--eval-batches`` global batches of it."""

        if spec is None:
            if not cfg.data.startswith("synthetic"):
                raise ValueError(
                    "--eval-interval: give the held-out pairs with --eval-data (a folder or tar "
                    "shards)"
                )
            size = cfg.eval_batches * cfg.global_batch_size
            spec = f"synthetic:{size}"
        return IndexedPairs(open_pairs(spec, self._image_size(cfg), cfg.seed, split="eval"))

    def loader(self, dataset: Any, cfg, ctx) -> Any:

        return PairLoader(
            dataset,
            **batch_args(cfg, ctx),
        )

    def collator(self, config: SiglipConfig, dataset: Any, checkpoint: Path | None):

        return PairCollator(config, dataset, checkpoint)

    def input_problem(self, config: SiglipConfig, mb: Microbatch, cfg) -> str | None:
        """Shapes that would fail inside the towers or unbalance the ring (all ranks exchange
        blocks of ``--micro-batch-size`` rows)."""
        px, ids, s = mb["pixel_values"], mb["input_ids"], config.image_size
        m, limit = cfg.micro_batch_size, config.text.max_length
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

    def loss_units(self, mb: Microbatch) -> int:
        return int(mb["pixel_values"].shape[0])

    # -- objective -----------------------------------------------------------------------------
    def backward_passes(self, num_microbatches: int) -> int:
        return num_microbatches  # the towers: one backward per microbatch (GradCache)

    def forward_backward(self, chunks, microbatches, ctx, cfg):

        (model,) = chunks
        dev = ctx.device
        pairs = [(mb["pixel_values"].to(dev), mb["input_ids"].to(dev)) for mb in microbatches]
        result = contrastive_step(model, pairs)
        b = float(result.samples)
        bias = model.logit_bias.detach().float() if model.logit_bias is not None else None
        local = [
            result.local_loss.float() * b,
            model.logit_scale.detach().float().exp().reshape(()) * b,
            (bias.reshape(()) * b) if bias is not None else torch.zeros((), device=dev),
            torch.tensor(float(sum(int(mb.get("truncated", 0)) for mb in microbatches))),
            torch.tensor(float(sum(int(mb.get("resized", 0)) for mb in microbatches))),
            torch.tensor(b),
        ]
        sums = torch.stack([x.to(dev) for x in local])
        comm.all_reduce(sums, ctx.dp_group)
        return sums[0] / sums[-1], sums

    @torch.no_grad()
    def evaluate_step(self, chunks, microbatches, ctx, cfg) -> torch.Tensor:

        return evaluate_batch(chunks[0], microbatches, ctx, KS)

    # -- reporting -----------------------------------------------------------------------------
    def flops(
        self,
        config: SiglipConfig,
        microbatches: Sequence[Microbatch],
        cfg,
        model: nn.Module | None = None,
    ) -> float:
        """``SiglipConfig.flops_per_sample``: 3 x (both towers' forward + the loss's logits
        against the global batch) per pair; GradCache's extra forward not counted."""
        n = sum(mb["pixel_values"].shape[0] for mb in microbatches)
        return n * config.flops_per_sample(cfg.global_batch_size)

    def block_estimates(self, config: SiglipConfig, cfg) -> list[BlockEstimate]:
        """:func:`parallax.families.siglip.estimate.block_estimates`; GradCache keeps one
        microbatch's activations at a time, whatever the microbatches of a step."""
        return block_estimates(config, cfg)

    def tokens(self, config: SiglipConfig, microbatches: Sequence[Microbatch]) -> int:
        return sum(
            mb["input_ids"].numel() + mb["input_ids"].shape[0] * config.vision.num_patches
            for mb in microbatches
        )

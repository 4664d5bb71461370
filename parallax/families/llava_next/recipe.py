"""LLaVA-NeXT (LLaVA-v1.6) as a recipe: the second vision-language family of the one Trainer.

Blocks are ``["vision", "llm.0", ..., "head"]`` (:meth:`parallax.models.LlavaNext.stage_blocks`):
the first stage takes ``(pixel_values, input_ids, image_sizes)``, every later one the hidden
states ``(b, t, h)`` of its microbatch, whose ``t`` (text plus image tokens of the longest
sample) differs from one microbatch to the next. Samples are right-padded; attention is causal,
so every real token precedes the padding and never attends to it: the padded activations are
all that travels between stages (no mask), and the padding carries no label. The loader groups
samples of similar length (:class:`~parallax.data.LengthGroupedLoader`, LLaVA's modality-length
sampler), and the loss of every microbatch is its sum over supervised tokens divided by the
supervised tokens of the whole global batch (the Trainer counts them over dp), so every layout
and every grouping gives the same update.

Defaults as LLaVA-v1.6 fine-tunes: peak learning rate 2e-5 for the projector and the language
model and a tenth of it for the CLIP tower (``--lr-groups "vision_tower.*=LR/10"`` unless
``--lr-groups`` is given; ``--lr-groups ""`` trains everything at ``--lr``). Stage 1 (the
projector only) is ``--freeze vision,llm``. Metrics are the teacher-forced answer accuracy (every
supervised token of a sample right) and token accuracy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.data import LengthGroupedLoader, SyntheticVQA
from parallax.families.llava_next.batches import (
    SYNTHETIC_SYSTEM,
    LlavaBatches,
    open_dataset,
    sample_counts,
    sample_lengths,
    text_tokenizer,
)
from parallax.families.llava_next.checkpoint import detect_layout
from parallax.families.llava_next.config import PRESETS, LlavaNextConfig
from parallax.families.llava_next.estimate import TYPICAL_TEXT_TOKENS, block_estimates
from parallax.families.llava_next.flops import sample_flops
from parallax.families.llava_next.model import LlavaNext
from parallax.families.llava_next.objectives import (
    answer_metrics,
    labelled_rows,
    llava_loss,
    loss_token_count,
    rows_answer_metrics,
    rows_loss,
)
from parallax.families.llava_next.vision import check_inputs, image_sizes_list
from parallax.models.estimate import BlockEstimate
from parallax.models.hf_io import CheckpointReader
from parallax.models.stages import StageBlock
from parallax.models.vlm import with_fusion
from parallax.pipeline import TensorMeta
from parallax.recipe.protocol import MetricSpec, Microbatch, ModelSpec, Recipe, batch_args

log = logging.getLogger(__name__)

DEFAULT_LR = {"llava-tiny": 3e-3}
DEFAULT_LR_7B = 2e-5  # LLaVA-v1.6's fine-tuning rate
VISION_LR_FACTOR = 0.1  # LLaVA-v1.6: mm_vision_tower_lr 2e-6 against 2e-5


class LlavaRecipe(Recipe):
    name = "llava"
    metric_sums = ("token_correct", "tokens", "answers_correct", "answers")
    metrics = (
        MetricSpec("answer_accuracy", "answers_correct", "answers", "acc"),
        MetricSpec("token_accuracy", "token_correct", "tokens", "tok"),
    )
    freeze_aliases = {
        "vision": ("vision_tower.*",),
        "projector": ("multi_modal_projector.*", "image_newline"),
        "llm": ("language_model.*",),
    }
    input_keys = ("pixel_values", "input_ids", "image_sizes", "labels")

    # -- model ---------------------------------------------------------------------------------
    def presets(self) -> Sequence[str]:
        return tuple(PRESETS)

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        kind = config_json.get("model_type")
        return kind in ("llava_next", "llava", "llava_llama") or "mm_vision_tower" in config_json

    def resolve(self, spec: str) -> ModelSpec:
        if spec in PRESETS:
            return ModelSpec(LlavaNextConfig.preset(spec))
        path = Path(spec)
        if path.is_dir() and (path / "config.json").is_file():
            config = LlavaNextConfig.from_pretrained(path)
            detect_layout(CheckpointReader(path).weight_map, config, f"checkpoint {path}")
            return ModelSpec(config, path)
        raise ValueError(
            f"--model {spec!r} is neither a LLaVA-NeXT preset ({', '.join(sorted(PRESETS))}) "
            "nor a checkpoint directory with a config.json"
        )

    def default_lr(self, spec: str) -> float:
        return DEFAULT_LR.get(spec, DEFAULT_LR_7B)

    def default_lr_groups(self, spec: str, lr: float) -> Any:
        return {"vision_tower.*": lr * VISION_LR_FACTOR}

    def configure(self, config: LlavaNextConfig, cfg) -> LlavaNextConfig:
        return with_fusion(config, cfg.fused_projections)

    def blocks(self, config: LlavaNextConfig) -> list[StageBlock]:
        return LlavaNext.stage_blocks(config, TYPICAL_TEXT_TOKENS)

    def build(self, config, blocks, ctx, *, cfg, dtype, device, checkpoint) -> nn.Module:
        kw = dict(blocks=blocks, activation_checkpointing=cfg.checkpointing)
        if checkpoint is not None and torch.device(device).type != "meta":
            chunk = LlavaNext.from_pretrained(
                checkpoint, ctx, dtype=dtype, device=device, config=config, **kw
            )
        else:
            seed = None if torch.device(device).type == "meta" else cfg.seed  # shapes only
            chunk = LlavaNext(config, ctx, dtype=dtype, device=device, seed=seed, **kw)
        chunk.return_hidden = cfg.logits == "labelled"  # the loss applies the head
        return chunk

    def export(self, chunk: LlavaNext, path: Path, statistics: Mapping | None) -> None:
        chunk.save_pretrained(path)

    # -- data ----------------------------------------------------------------------------------
    def dataset(self, spec: str, cfg) -> Any:

        return open_dataset(spec, cfg.model_config, cfg.seed)

    def eval_dataset(self, spec: str | None, cfg) -> Any:
        """``--eval-data``, or for the synthetic task the samples of another seed."""
        if spec is None and cfg.data == "synthetic":
            return open_dataset("synthetic", cfg.model_config, cfg.seed, eval_split=True)
        return super().eval_dataset(spec, cfg)

    def collator(self, config: LlavaNextConfig, dataset: Any, checkpoint: Path | None):

        system = SYNTHETIC_SYSTEM if isinstance(dataset, SyntheticVQA) else None
        return LlavaBatches(config, text_tokenizer(config, checkpoint), system=system)

    def loader(self, dataset, cfg, ctx) -> Any:
        """Length-grouped batches (:class:`~parallax.data.LengthGroupedLoader`); every sample's
        length is computed here from its metadata, so one that cannot fit fails before
        training."""

        batches = self.collator(cfg.model_config, dataset, cfg.checkpoint)
        lengths, images = sample_lengths(batches, dataset)
        return LengthGroupedLoader(
            dataset,
            lengths,
            images,
            **batch_args(cfg, ctx),
        )

    def input_problem(self, config: LlavaNextConfig, mb: Microbatch, cfg) -> str | None:
        """Tiles and image tokens that do not fit the image sizes, found on the host before
        the step (the model would otherwise raise on the first stage only)."""

        try:
            b = mb["input_ids"].shape[0]
            check_inputs(
                config, mb["pixel_values"], mb["input_ids"], image_sizes_list(mb["image_sizes"], b)
            )
        except ValueError as err:
            return str(err)
        return None

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        return mb["pixel_values"], mb["input_ids"], mb["image_sizes"]

    def stage_metas(self, config: LlavaNextConfig, mb: Microbatch, dtype) -> list[TensorMeta]:
        b, t = mb["input_ids"].shape
        return [TensorMeta((b, t, config.text.hidden_size), dtype, True)]

    # -- objective -----------------------------------------------------------------------------
    def loss_units(self, mb: Microbatch) -> int:
        return int(loss_token_count(mb["labels"]))

    def loss_target(self, config: LlavaNextConfig, mb: Microbatch, cfg) -> Any:
        if cfg.logits != "labelled":
            return mb["labels"]
        rows, targets = labelled_rows(mb["labels"])  # found on the host
        b, t = mb["labels"].shape
        return rows, targets, t, b

    def loss(self, chunk: LlavaNext, output, target, ctx, cfg):
        vocab = chunk.config.vocab_size
        if cfg.logits == "labelled":
            rows, row_targets, t, b = target
            hidden = output.flatten(0, 1).index_select(0, rows)  # (n, h), the same on every tp
            logits = chunk.head(hidden)  # (n, V/tp)
            ce = rows_loss(logits, row_targets, ctx, vocab_size=vocab)
            m = rows_answer_metrics(logits, row_targets, rows, t, b, ctx, vocab_size=vocab)
        else:
            ce = llava_loss(output, target, ctx, vocab_size=vocab, reduction="sum")
            m = answer_metrics(output, target, ctx, vocab_size=vocab)
        return ce, torch.stack([m[k] for k in self.metric_sums])

    # -- reporting -----------------------------------------------------------------------------
    def flops(
        self,
        config: LlavaNextConfig,
        microbatches: Sequence[Microbatch],
        cfg,
        model: nn.Module | None = None,
    ) -> float:
        """:func:`~parallax.families.llava_next.flops.sample_flops` of every sample's real
        tokens and tiles (padding not counted); the tower's backward only where ``model`` (the
        whole model on meta as the run adapts it) trains it."""
        patch = "vision_tower.patch_embed.proj.weight"
        trained = model is None or model.get_parameter(patch).requires_grad
        labelled = cfg.logits == "labelled"
        total = 0.0
        for mb in microbatches:
            rows = (mb["labels"][:, 1:] != -100).sum(1).tolist() if labelled else None
            for i, (n, tiles) in enumerate(zip(*sample_counts(config, mb))):
                total += sample_flops(
                    config,
                    tiles,
                    n,
                    vision_trained=trained,
                    logits_rows=rows[i] if labelled else None,
                )
        return total

    def block_estimates(self, config: LlavaNextConfig, cfg) -> list[BlockEstimate]:
        """:func:`parallax.families.llava_next.estimate.block_estimates`."""
        return block_estimates(config, cfg)

    def tokens(self, config: LlavaNextConfig, microbatches: Sequence[Microbatch]) -> int:
        """Real tokens (text and image) of these microbatches, padding not counted."""

        return sum(sum(sample_counts(config, mb)[0]) for mb in microbatches)

"""LLaVA-NeXT's model and data sides (:mod:`parallax.families.llava_next.recipe` composes
them with the answer objective)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.data import LengthGroupedLoader
from parallax.families.llava_next.batches import LlavaBatches, sample_counts, text_tokenizer
from parallax.families.llava_next.checkpoint import detect_layout
from parallax.families.llava_next.config import PRESETS, LlavaNextConfig
from parallax.families.llava_next.data import SYNTHETIC_SYSTEM, open_dataset, sample_lengths
from parallax.families.llava_next.estimate import TYPICAL_TEXT_TOKENS, block_estimates
from parallax.families.llava_next.flops import sample_flops
from parallax.families.llava_next.model import LlavaNext
from parallax.families.llava_next.synthetic import SyntheticVQA
from parallax.families.llava_next.vision import check_inputs, image_sizes_list
from parallax.models.estimate import BlockEstimate
from parallax.models.hf_io import CheckpointReader
from parallax.models.stages import StageBlock
from parallax.models.vlm import with_fusion
from parallax.pipeline import TensorMeta
from parallax.recipe import DataSide, Microbatch, ModelSide, ModelSpec, batch_args
from parallax.recipe.model_side import preset_or_checkpoint, vlm_chunk
from parallax.run import Run

log = logging.getLogger(__name__)

DEFAULT_LR = {"llava-tiny": 3e-3}
DEFAULT_LR_7B = 2e-5  # LLaVA-v1.6's fine-tuning rate
VISION_LR_FACTOR = 0.1  # LLaVA-v1.6: mm_vision_tower_lr 2e-6 against 2e-5


class LlavaModel(ModelSide):
    """The CLIP tower, the projector and the Vicuna decoder, as pipeline blocks."""

    freeze_aliases = {
        "vision": ("vision_tower.*",),
        "projector": ("multi_modal_projector.*", "image_newline"),
        "llm": ("language_model.*",),
    }

    def presets(self) -> Sequence[str]:
        return tuple(PRESETS)

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        kind = config_json.get("model_type")
        return kind in ("llava_next", "llava", "llava_llama") or "mm_vision_tower" in config_json

    def resolve(self, spec: str) -> ModelSpec:
        found = preset_or_checkpoint(spec, LlavaNextConfig, "a LLaVA-NeXT preset", sorted(PRESETS))
        if found.checkpoint is not None:  # one of the layouts parallax reads, checked up front
            path = found.checkpoint
            detect_layout(CheckpointReader(path).weight_map, found.config, f"checkpoint {path}")
        return found

    def default_lr(self, spec: str) -> float:
        return DEFAULT_LR.get(spec, DEFAULT_LR_7B)

    def default_lr_groups(self, spec: str, lr: float) -> Any:
        return {"vision_tower.*": lr * VISION_LR_FACTOR}

    def configure(self, run: Run) -> LlavaNextConfig:
        return with_fusion(run.model_config, run.fused_projections)

    def blocks(self, config: LlavaNextConfig) -> list[StageBlock]:
        return LlavaNext.stage_blocks(config, TYPICAL_TEXT_TOKENS)

    def build(self, run, blocks, ctx, *, dtype, device, checkpoint) -> nn.Module:
        read = checkpoint if torch.device(device).type != "meta" else None  # meta: shapes only
        return vlm_chunk(LlavaNext, run, blocks, ctx, dtype=dtype, device=device, checkpoint=read)

    def export(self, run: Run, chunk: LlavaNext, path: Path, statistics: Mapping | None) -> None:
        chunk.save_pretrained(path)

    def flops(self, run: Run, microbatches: Sequence[Microbatch], model=None) -> float:
        """:func:`~parallax.families.llava_next.flops.sample_flops` of every sample's real
        tokens and tiles (padding not counted); the tower's backward only where ``model`` (the
        whole model on meta as the run adapts it) trains it."""
        patch = "vision_tower.patch_embed.proj.weight"
        trained = model is None or model.get_parameter(patch).requires_grad
        labelled = run.logits == "labelled"
        total = 0.0
        for mb in microbatches:
            rows = (mb["labels"][:, 1:] != -100).sum(1).tolist() if labelled else None
            for i, (n, tiles) in enumerate(zip(*sample_counts(run.model_config, mb))):
                total += sample_flops(
                    run.model_config,
                    tiles,
                    n,
                    vision_trained=trained,
                    logits_rows=rows[i] if labelled else None,
                )
        return total

    def block_estimates(self, run: Run) -> list[BlockEstimate]:
        """:func:`parallax.families.llava_next.estimate.block_estimates`."""
        return block_estimates(run.model_config, run)

    def tokens(self, run: Run, microbatches: Sequence[Microbatch]) -> int:
        """Real tokens (text and image) of these microbatches, padding not counted."""
        return sum(sum(sample_counts(run.model_config, mb)[0]) for mb in microbatches)


class LlavaData(DataSide):
    """LLaVA conversations (or the synthetic visual questions), grouped by length."""

    input_keys = ("pixel_values", "input_ids", "image_sizes", "labels")

    def dataset(self, spec: str, run: Run) -> Any:
        return open_dataset(spec, run.model_config, run.seed)

    def eval_dataset(self, spec: str | None, run: Run) -> Any:
        """``--eval-data``, or for the synthetic task the samples of another seed."""
        if spec is None and run.data == "synthetic":
            return open_dataset("synthetic", run.model_config, run.seed, eval_split=True)
        return super().eval_dataset(spec, run)

    def collator(self, run: Run, dataset: Any):
        system = SYNTHETIC_SYSTEM if isinstance(dataset, SyntheticVQA) else None
        tokenizer = text_tokenizer(run.model_config, run.checkpoint)
        return LlavaBatches(run.model_config, tokenizer, system=system)

    def loader(self, dataset, run: Run, ctx) -> Any:
        """Length-grouped batches (:class:`~parallax.data.LengthGroupedLoader`); every sample's
        length is computed here from its metadata, so one that cannot fit fails before
        training."""
        lengths, images = sample_lengths(self.collator(run, dataset), dataset)
        return LengthGroupedLoader(dataset, lengths, images, **batch_args(run, ctx))

    def input_problem(self, run: Run, mb: Microbatch) -> str | None:
        """Tiles and image tokens that do not fit the image sizes, found on the host before
        the step (the model would otherwise raise on the first stage only)."""
        try:
            b = mb["input_ids"].shape[0]
            sizes = image_sizes_list(mb["image_sizes"], b)
            check_inputs(run.model_config, mb["pixel_values"], mb["input_ids"], sizes)
        except ValueError as err:
            return str(err)
        return None

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        return mb["pixel_values"], mb["input_ids"], mb["image_sizes"]

    def stage_metas(self, run: Run, mb: Microbatch, dtype) -> list[TensorMeta]:
        b, t = mb["input_ids"].shape
        return [TensorMeta((b, t, run.model_config.text.hidden_size), dtype, True)]

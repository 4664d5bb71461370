"""OpenVLA's model and data sides (:mod:`parallax.families.openvla.recipe` composes them with
the action-token objective; OpenVLA-OFT's derive from them in
:mod:`parallax.families.openvla.oft.sides`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.data import Mixture, SyntheticTask, load_dataset
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.families.openvla.config import PRESETS, OpenVLAConfig
from parallax.families.openvla.data import is_streamed, open_mixture, stream_loader
from parallax.families.openvla.estimate import block_estimates
from parallax.families.openvla.flops import batch_flops
from parallax.families.openvla.lora_flops import openvla_linear_costs, openvla_lora_flops
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.objective import loss_token_count
from parallax.families.openvla.oft.head import LORA_EXCLUDE
from parallax.families.openvla.oft.options import OFTOptions
from parallax.models.estimate import BlockEstimate
from parallax.models.stages import StageBlock
from parallax.models.vlm import with_fusion
from parallax.pipeline import TensorMeta
from parallax.recipe import DataSide, Microbatch, ModelSide, ModelSpec
from parallax.recipe.model_side import preset_or_checkpoint, vlm_chunk
from parallax.run import Run

log = logging.getLogger(__name__)


# Peak learning rates that train each preset well from scratch on the synthetic task; a 7B
# model (preset or checkpoint) gets OpenVLA's full fine-tuning rate.
DEFAULT_LR = {"tiny": 1e-3, "small": 3e-4}
DEFAULT_LR_7B = 2e-5


class OpenVLAData(DataSide):
    """Robot data (RLDS, LIBERO, LeRobot, mixtures) streamed, the synthetic task and parallax
    episode folders with random access; microbatches of OpenVLA's prompts and action tokens."""

    input_keys = ("pixel_values", "input_ids")  # and "labels" (input_problem)
    pads_text = True  # the collator rounds the text up (--pad-to-multiple-of)

    def dataset(self, spec: Any, run: Run) -> Any:
        """Robot data as a scanned :class:`~parallax.data.Mixture` to stream
        (:mod:`parallax.families.openvla.data`); the synthetic task and parallax directories as
        random-access datasets."""
        if is_streamed(spec):
            return open_mixture(run.replace(data=spec))
        return load_dataset(spec, seed=run.seed, chunk=self.chunk(run))

    def chunk(self, run: Run) -> int:
        """Actions per sample: one (OFT's data side: its chunk)."""
        return 1

    def eval_dataset(self, spec: str | None, run: Run) -> Any:
        """``--eval-data`` (read with random access, in a fixed order), or for the synthetic
        task the episodes of another seed (scenes the run never trains on)."""
        if spec is None and run.data == "synthetic":
            return SyntheticTask(seed=run.seed + 1)
        if spec is None:
            return super().eval_dataset(spec, run)
        return load_dataset(spec, seed=run.seed, chunk=self.chunk(run))

    def loader(self, dataset: Any, run: Run, ctx) -> Any:
        """Streamed robot data: :class:`~parallax.data.StreamLoader`, its images resized to the
        model's resolution (then augmented, as OpenVLA does at 224 px)."""
        if not isinstance(dataset, Mixture):
            if run.augment:
                log.info("--augment applies to streamed robot data only: not augmenting")
            return super().loader(dataset, run, ctx)
        return stream_loader(
            dataset, run, ctx, run.model_config.image_size, **self.stream(run, dataset)
        )

    def stream(self, run: Run, dataset: Mixture) -> dict[str, Any]:
        """What the streaming loader takes beyond the batch (OFT's cameras, state, chunks)."""
        return {}

    def collator(self, run: Run, dataset: Any):
        tokenizer = text_tokenizer(run.model_config, run.checkpoint)
        return BatchBuilder(run.model_config, dataset.statistics, tokenizer)

    def input_problem(self, run: Run, mb: Microbatch) -> str | None:
        return None if "labels" in mb else "lacks labels"

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        return mb["pixel_values"], mb["input_ids"]

    def stage_metas(self, run: Run, mb: Microbatch, dtype) -> list[TensorMeta]:
        b, t = mb["input_ids"].shape
        config: OpenVLAConfig = run.model_config
        return [TensorMeta((b, config.prefix_tokens + t, config.text.hidden_size), dtype, True)]


class OpenVLAModel(ModelSide):
    """The two towers, the projector and Llama-2, as pipeline blocks. ``data``: the recipe's
    data side, whose synthetic samples give the planner a typical prompt width."""

    freeze_aliases = {"vision": ("vision_backbone.*",)}
    # OFT's column-parallel linears are trained whole, never adapted (oft.head.LORA_EXCLUDE)
    lora_exclude = ("lm_head", *LORA_EXCLUDE)

    def __init__(self, data: OpenVLAData) -> None:
        self.data = data

    def presets(self) -> Sequence[str]:
        return tuple(PRESETS)

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        return config_json.get("model_type") in ("openvla", "prismatic")

    def resolve(self, spec: str) -> ModelSpec:
        return preset_or_checkpoint(spec, OpenVLAConfig, "an OpenVLA preset", sorted(PRESETS))

    def default_lr(self, spec: str) -> float:
        return DEFAULT_LR.get(spec, DEFAULT_LR_7B)

    def configure(self, run: Run) -> OpenVLAConfig:
        """Fused projections as asked, the text rounded up as ``--pad-to-multiple-of`` asks."""
        config = with_fusion(run.model_config, run.fused_projections)
        return dataclasses.replace(config, text_multiple=run.pad_to_multiple_of)

    def blocks(self, config: OpenVLAConfig) -> list[StageBlock]:
        return OpenVLA.stage_blocks(config)

    def resume_problem(self, run: Run, saved: Mapping[str, Any]) -> str | None:
        """A checkpoint of the other head, or of OFT's head at another chunk or FiLM."""
        was = OFTOptions(**{k: saved[k] for k in OFT_FIELDS if k in saved})
        now: OFTOptions = run.family_options
        if not was.l1 and not now.l1:
            return None
        if was.l1 != now.l1:
            how = (
                f"an OpenVLA-OFT run (L1 head, {_oft_words(was)})"
                if was.l1
                else ("a run of OpenVLA's action tokens (--action-head tokens)")
            )
            fix = f"resume with {_oft_flags(was)}" if was.l1 else "drop --action-head l1"
            return f"the checkpoint was written by {how}; {fix}"
        if (was.chunk, was.film) != (now.chunk, now.film):
            return (
                f"the checkpoint's OFT head predicts {_oft_words(was)}, this run asks for "
                f"{_oft_words(now)}; resume with {_oft_flags(was)}"
            )
        return None

    def build(self, run, blocks, ctx, *, dtype, device, checkpoint) -> nn.Module:
        # the reader's seed starts OFT's modules where a plain OpenVLA checkpoint has none
        kw = dict(dtype=dtype, device=device, checkpoint=checkpoint, seed=run.seed)
        return vlm_chunk(OpenVLA, run, blocks, ctx, **kw)

    def export(self, run: Run, chunk: OpenVLA, path: Path, statistics: Mapping | None) -> None:
        """The HF OpenVLA layout (merged with LoRA), with the data's statistics."""
        if statistics:
            chunk.config = dataclasses.replace(
                chunk.config, norm_stats={**chunk.config.norm_stats, **statistics}
            )
        chunk.save_pretrained(path)

    def flops(self, run: Run, microbatches: Sequence[Microbatch], model=None) -> float:
        """:func:`~parallax.families.openvla.flops.batch_flops`, or with LoRA
        :func:`~parallax.families.openvla.lora_flops.openvla_lora_flops` (no weight gradient
        for the frozen base: ~4 x params x tokens). ``model``: the whole model on meta as the
        run adapts it (without it, every parameter trains)."""
        if run.finetune == "lora":
            if model is None:
                raise ValueError("LoRA FLOPs are counted on the adapted whole model: pass it")
            return self._lora_flops(model, microbatches, run)
        patch = "vision_backbone.featurizer.patch_embed.proj.weight"
        frozen = model is not None and not model.get_parameter(patch).requires_grad
        return batch_flops(
            run.model_config,
            microbatches,
            labelled_logits=run.logits == "labelled",
            frozen_vision=frozen,
        )

    def _lora_flops(self, model: nn.Module, microbatches, run: Run) -> float:
        """The per-layer costs are found once per adapted model (one forward on meta)."""
        cached = getattr(self, "_lora_costs", None)
        if cached is None or cached[0] is not model:
            cached = self._lora_costs = (model, openvla_linear_costs(model))
        total = 0.0
        for mb in microbatches:
            b, t = mb["input_ids"].shape
            rows = loss_token_count(mb["labels"]) / b if run.logits == "labelled" else None
            total += b * openvla_lora_flops(model, t, rows, cached[1])
        return total

    def block_estimates(self, run: Run) -> list[BlockEstimate]:
        """:func:`parallax.families.openvla.estimate.block_estimates`."""
        return block_estimates(self, run)

    def tokens(self, run: Run, microbatches: Sequence[Microbatch]) -> int:
        """The sequence the language model sees, without the padding (tokens/s counts the
        data, not the pads a batch or ``--pad-to-multiple-of`` adds; the FLOPs count all)."""
        config: OpenVLAConfig = run.model_config
        total = 0
        for mb in microbatches:
            ids = mb["input_ids"]  # (b, t)
            real = mb.get("attention_mask")  # OFT's; its empty slots hold the pad id
            real = ids != config.pad_token_id if real is None else real
            total += int(real.sum()) + ids.shape[0] * config.prefix_tokens
        return total


OFT_FIELDS = ("action_head", "action_chunk", "film")


def _oft_words(o: OFTOptions) -> str:
    return f"chunks of {o.chunk}, FiLM {'on' if o.film else 'off'}"


def _oft_flags(o: OFTOptions) -> str:
    return f"--action-head l1 --action-chunk {o.chunk}" + (" --film" if o.film else "")

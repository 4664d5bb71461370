"""OpenVLA-OFT's model and data sides: OpenVLA's, with OFT's head, cameras and state.

The model side adds OFT's options to the config (the chunk and FiLM from the flags; the action
and state sizes and the cameras from the data: :func:`~.data.with_oft`), reads the hidden
states into the L1 head (the lm_head never runs) and exports OFT's own files beside the HF
layout. The data side gives the synthetic task's OFT form, the streaming loader's cameras,
state and chunks, and OFT's microbatches (:class:`~.batches.OFTBatchBuilder`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.families.openvla.batches import text_tokenizer
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.oft import objective as oft_objective
from parallax.families.openvla.oft.batches import OFTBatchBuilder
from parallax.families.openvla.oft.data import (
    DataShape,
    data_shape,
    stream_kwargs,
    synthetic_task,
    with_oft,
)
from parallax.families.openvla.oft.export import save_oft_modules
from parallax.families.openvla.oft.head import FILM_LINEARS
from parallax.families.openvla.sides import OpenVLAData, OpenVLAModel
from parallax.pipeline import TensorMeta
from parallax.recipe import Microbatch
from parallax.run import Run


class OFTData(OpenVLAData):
    """OFT's microbatches: every camera, the proprio state and the action chunk."""

    def __init__(self) -> None:
        # what the run's --data opened (configuring the model reads its shape; the run then
        # trains on it): opened once, its scan and messages once
        self._opened: dict[str, Any] = {}

    def shape(self, run: Run) -> DataShape:
        """What ``run.data`` gives an OFT model."""
        return data_shape(self.dataset(run.data, run))

    def dataset(self, spec: Any, run: Run) -> Any:
        key = repr((spec, run.data_config, run.seed, run.family_options.chunk, run.out))
        if key not in self._opened:
            if spec == "synthetic":
                self._opened[key] = synthetic_task(run.family_options, run.seed)
            else:
                self._opened[key] = super().dataset(spec, run)
        return self._opened[key]

    def eval_dataset(self, spec: str | None, run: Run) -> Any:
        if spec is None and run.data == "synthetic":
            return synthetic_task(run.family_options, run.seed + 1)
        return super().eval_dataset(spec, run)

    def chunk(self, run: Run) -> int:
        return run.family_options.chunk

    def stream(self, run: Run, dataset) -> dict[str, Any]:
        return stream_kwargs(run.family_options, data_shape(dataset))

    def collator(self, run: Run, dataset: Any):
        tokenizer = text_tokenizer(run.model_config, run.checkpoint)
        return OFTBatchBuilder(run.model_config, dataset.statistics, tokenizer)

    def input_problem(self, run: Run, mb: Microbatch) -> str | None:
        return oft_objective.input_problem(run.model_config, mb)

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        proprio = (mb["proprio"],) if "proprio" in mb else ()
        masks = mb["attention_mask"], mb["action_mask"]
        return (mb["pixel_values"], mb["input_ids"], *proprio, *masks)

    def stage_metas(self, run: Run, mb: Microbatch, dtype) -> list[TensorMeta]:
        b, t = mb["input_ids"].shape
        config: OpenVLAConfig = run.model_config
        s, h = config.prefix_tokens + t, config.text.hidden_size
        return [TensorMeta((b, s, h), dtype, True), TensorMeta((b, s), torch.bool, False)]


class OFTModel(OpenVLAModel):
    """OpenVLA with OFT's L1 head (and proprio projector, FiLM)."""

    data: OFTData

    def configure(self, run: Run) -> OpenVLAConfig:
        """OpenVLA's options, then OFT's: the flags' chunk and FiLM, the data's sizes and
        cameras (:func:`~.data.with_oft`)."""
        config = super().configure(run)
        return with_oft(config, run, lambda: self.data.shape(run))

    def fully_trained(self, run: Run) -> tuple[str, ...]:
        """OFT's new modules train whole beside LoRA's adapters (and stay out of the PEFT
        adapter: the export writes them apart, as OFT does)."""
        return ("action_head", "proprio_projector", *FILM_LINEARS)

    def build(self, run, blocks, ctx, *, dtype, device, checkpoint) -> nn.Module:
        chunk = super().build(run, blocks, ctx, dtype=dtype, device=device, checkpoint=checkpoint)
        chunk.return_hidden = True  # the L1 head reads hidden states; the lm_head never runs
        if chunk.has_head:
            chunk.language_model.lm_head.requires_grad_(False)
        return chunk

    def export(self, run: Run, chunk, path: Path, statistics: Mapping | None) -> None:
        """OpenVLA's HF layout, and the head, projector and FiLM also as safetensors and under
        OFT's own file names (:mod:`.export`)."""
        super().export(run, chunk, path, statistics)
        save_oft_modules(chunk, path, step=run.steps)

    def flops(self, run: Run, microbatches: Sequence[Microbatch], model=None) -> float:
        """OpenVLA-OFT's (:func:`~parallax.families.openvla.oft.objective.batch_flops`)."""
        lora = run.finetune == "lora"
        return oft_objective.batch_flops(run.model_config, microbatches, lora)

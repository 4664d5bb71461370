"""OpenVLA as a recipe: the first model family the one Trainer runs.

Blocks are ``["vision", "llm.0", ..., "head"]`` (:meth:`parallax.models.OpenVLA.stage_blocks`);
the first stage takes ``(pixel_values, input_ids)``, later ones the hidden states
``(b, P + t, h)``. The loss is the next-token cross-entropy summed over the labelled tokens (the
7 action tokens and EOS of each sample); with ``--logits labelled`` the last stage returns hidden
states and the loss applies the final norm and lm_head to the labelled rows only. Metrics are
OpenVLA's action-token accuracy and the L1 error of the decoded actions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.data import Mixture, SyntheticTask, load_dataset
from parallax.families.openvla import oft_objective
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.families.openvla.config import PRESETS, OpenVLAConfig
from parallax.families.openvla.data import is_streamed, open_mixture, stream_loader
from parallax.families.openvla.estimate import block_estimates
from parallax.families.openvla.flops import batch_flops
from parallax.families.openvla.lora_flops import openvla_linear_costs, openvla_lora_flops
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.objectives import (
    action_metrics,
    labelled_rows,
    loss_token_count,
    rows_action_metrics,
    rows_loss,
    vla_loss,
)
from parallax.families.openvla.oft_batches import OFTBatchBuilder
from parallax.families.openvla.oft_data import data_shape, stream_kwargs, synthetic_task, with_oft
from parallax.families.openvla.oft_export import save_oft_modules
from parallax.families.openvla.oft_head import FILM_LINEARS, LORA_EXCLUDE
from parallax.models.estimate import BlockEstimate
from parallax.models.stages import StageBlock
from parallax.models.vlm import with_fusion
from parallax.pipeline import TensorMeta
from parallax.recipe.protocol import MetricSpec, Microbatch, ModelSpec, Recipe

log = logging.getLogger(__name__)


# Peak learning rates that train each preset well from scratch on the synthetic task; a 7B
# model (preset or checkpoint) gets OpenVLA's full fine-tuning rate.
DEFAULT_LR = {"tiny": 1e-3, "small": 3e-4}
DEFAULT_LR_7B = 2e-5


class OpenVLARecipe(Recipe):
    name = "openvla"
    metric_sums = ("action_correct", "action_l1_sum", "action_tokens")
    metrics = (
        MetricSpec("action_accuracy", "action_correct", "action_tokens", "acc"),
        MetricSpec("l1", "action_l1_sum", "action_tokens", "l1"),
    )
    freeze_aliases = {"vision": ("vision_backbone.*",)}
    input_keys = ("pixel_values", "input_ids")  # and "labels", or OFT's (input_problem)
    # OFT's column-parallel linears are trained whole, never adapted (oft_head.LORA_EXCLUDE)
    lora_exclude = ("lm_head", *LORA_EXCLUDE)
    pads_text = True  # both collators round the text up (--pad-to-multiple-of)

    def __init__(self) -> None:
        self._data_shapes: dict = {}  # the OFT inputs of each opened --data (oft_data)
        self._export_step: int | None = None

    # -- model ---------------------------------------------------------------------------------
    def presets(self) -> Sequence[str]:
        return tuple(PRESETS)

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        return config_json.get("model_type") in ("openvla", "prismatic")

    def resolve(self, spec: str) -> ModelSpec:
        if spec in PRESETS:
            return ModelSpec(OpenVLAConfig.preset(spec))
        path = Path(spec)
        if path.is_dir() and (path / "config.json").is_file():
            return ModelSpec(OpenVLAConfig.from_pretrained(path), path)
        raise ValueError(
            f"--model {spec!r} is neither an OpenVLA preset ({', '.join(sorted(PRESETS))}) nor "
            "a checkpoint directory with a config.json"
        )

    def default_lr(self, spec: str) -> float:
        return DEFAULT_LR.get(spec, DEFAULT_LR_7B)

    def configure(self, config: OpenVLAConfig, cfg) -> OpenVLAConfig:
        """Fused projections as asked; with ``--action-head l1`` OFT's options, the action and
        state sizes and the cameras from the data (:mod:`.oft_data`). The recipe's metrics
        follow the objective of the run configured last (one run per process)."""
        config = with_fusion(config, cfg.fused_projections)
        config = dataclasses.replace(config, text_multiple=cfg.pad_to_multiple_of)
        self._export_step = cfg.steps
        if cfg.action_head != "l1":
            if config.oft is not None:
                raise ValueError(
                    f"--model {cfg.model} is an OpenVLA-OFT model (an L1 action head): "
                    "train it with --action-head l1"
                )
            self.metric_sums, self.metrics = type(self).metric_sums, type(self).metrics
            return config
        self.metric_sums, self.metrics = oft_objective.METRIC_SUMS, oft_objective.METRICS
        return with_oft(config, cfg, lambda: self.data_shape(cfg))

    def data_shape(self, cfg):
        """What ``cfg.data`` gives an OFT model (opened once per process and data spec)."""
        key = repr((cfg.data, cfg.data_config, cfg.seed, cfg.action_chunk))
        if key not in self._data_shapes:
            self._data_shapes[key] = data_shape(self.dataset(cfg.data, cfg))
        return self._data_shapes[key]

    def fully_trained(self, cfg) -> tuple[str, ...]:
        """OFT's new modules train whole beside LoRA's adapters (and stay out of the PEFT
        adapter: the export writes them apart, as OFT does)."""
        if cfg.action_head != "l1":
            return ()
        return ("action_head", "proprio_projector", *FILM_LINEARS)

    def blocks(self, config: OpenVLAConfig) -> list[StageBlock]:
        return OpenVLA.stage_blocks(config)

    def build(self, config, blocks, ctx, *, cfg, dtype, device, checkpoint) -> nn.Module:
        kw = dict(blocks=blocks, activation_checkpointing=cfg.checkpointing)
        if checkpoint is not None:
            chunk = OpenVLA.from_pretrained(
                checkpoint, ctx, dtype=dtype, device=device, config=config, seed=cfg.seed, **kw
            )
        else:
            seed = None if torch.device(device).type == "meta" else cfg.seed  # shapes only
            chunk = OpenVLA(config, ctx, dtype=dtype, device=device, seed=seed, **kw)
        chunk.return_hidden = cfg.logits == "labelled"  # the loss applies the head
        if config.oft is not None:  # the L1 head reads hidden states; the lm_head never runs
            chunk.return_hidden = True
            if chunk.has_head:
                chunk.language_model.lm_head.requires_grad_(False)
        return chunk

    def export(self, chunk: OpenVLA, path: Path, statistics: Mapping | None) -> None:
        """The HF OpenVLA layout (merged with LoRA); an OFT model's head, projector and FiLM
        also as safetensors and under OFT's own file names (:mod:`.oft_export`)."""
        if statistics:
            chunk.config = dataclasses.replace(
                chunk.config, norm_stats={**chunk.config.norm_stats, **statistics}
            )
        chunk.save_pretrained(path)
        if chunk.config.oft is not None:
            save_oft_modules(chunk, path, step=self._export_step)

    # -- data ----------------------------------------------------------------------------------
    def dataset(self, spec: Any, cfg) -> Any:
        """Robot data (RLDS, LIBERO, LeRobot, mixtures) as a scanned
        :class:`~parallax.data.Mixture` to stream (:mod:`parallax.families.openvla.data`); the
        synthetic task and parallax directories as random-access datasets."""

        if is_streamed(spec):
            return open_mixture(cfg.replace(data=spec))
        if spec == "synthetic" and cfg.action_head == "l1":
            return synthetic_task(cfg, cfg.seed)
        return load_dataset(spec, seed=cfg.seed)

    def eval_dataset(self, spec: str | None, cfg) -> Any:
        """``--eval-data`` (read with random access, in a fixed order), or for the synthetic
        task the episodes of another seed (scenes the run never trains on)."""

        if spec is None and cfg.data == "synthetic":
            if cfg.action_head == "l1":
                return synthetic_task(cfg, cfg.seed + 1)
            return SyntheticTask(seed=cfg.seed + 1)
        if spec is None:
            return super().eval_dataset(spec, cfg)
        return load_dataset(spec, seed=cfg.seed)

    def loader(self, dataset: Any, cfg, ctx) -> Any:
        """Streamed robot data: :class:`~parallax.data.StreamLoader`, its images resized to the
        model's resolution (then augmented, as OpenVLA does at 224 px)."""

        if not isinstance(dataset, Mixture):
            if cfg.augment:
                log.info("--augment applies to streamed robot data only: not augmenting")
            return super().loader(dataset, cfg, ctx)
        name = cfg.model.partition(":")[2] if cfg.model.startswith("openvla:") else cfg.model
        extra = {}
        if cfg.action_head == "l1":
            extra = stream_kwargs(cfg, data_shape(dataset))
        return stream_loader(dataset, cfg, ctx, self.resolve(name).config.image_size, **extra)

    def collator(self, config: OpenVLAConfig, dataset: Any, checkpoint: Path | None):

        tokenizer = text_tokenizer(config, checkpoint)
        if config.oft is not None:
            return OFTBatchBuilder(config, dataset.statistics, tokenizer)
        return BatchBuilder(config, dataset.statistics, tokenizer)

    def input_problem(self, config: OpenVLAConfig, mb: Microbatch, cfg) -> str | None:
        if config.oft is not None:
            return oft_objective.input_problem(config, mb)
        return None if "labels" in mb else "lacks labels"

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        if "action_mask" in mb:  # OFT's (oft_batches.stage_inputs)
            proprio = (mb["proprio"],) if "proprio" in mb else ()
            masks = mb["attention_mask"], mb["action_mask"]
            return (mb["pixel_values"], mb["input_ids"], *proprio, *masks)
        return mb["pixel_values"], mb["input_ids"]

    def stage_metas(self, config: OpenVLAConfig, mb: Microbatch, dtype) -> list[TensorMeta]:
        b, t = mb["input_ids"].shape
        s, h = config.prefix_tokens + t, config.text.hidden_size
        if config.oft is None:
            return [TensorMeta((b, s, h), dtype, True)]
        return [TensorMeta((b, s, h), dtype, True), TensorMeta((b, s), torch.bool, False)]

    # -- objective -----------------------------------------------------------------------------
    def loss_units(self, mb: Microbatch) -> int:
        if "actions" in mb and "action_mask" in mb:  # OFT: every action element
            return int(mb["actions"].numel())
        return int(loss_token_count(mb["labels"]))

    def loss_target(self, config: OpenVLAConfig, mb: Microbatch, cfg) -> Any:
        if config.oft is not None:
            return oft_objective.loss_target(config, mb)  # found on the host
        if cfg.logits != "labelled":
            return mb["labels"]
        return labelled_rows(mb["labels"], config.num_patches)  # found on the host

    def loss(self, chunk: OpenVLA, output, target, ctx, cfg):
        mc = chunk.config
        if mc.oft is not None:
            return oft_objective.l1_loss(chunk, output, target)
        vocab, tok = mc.text.vocab_size, chunk.action_tokenizer
        if cfg.logits == "labelled":
            rows, row_targets = target
            hidden = output.flatten(0, 1).index_select(0, rows)  # (n, h), the same on every tp
            logits = chunk.head(hidden)  # (n, V/tp)
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

    # -- reporting -----------------------------------------------------------------------------
    def flops(
        self,
        config: OpenVLAConfig,
        microbatches: Sequence[Microbatch],
        cfg,
        model: nn.Module | None = None,
    ) -> float:
        """:func:`~parallax.families.openvla.flops.batch_flops`, or with LoRA
        :func:`~parallax.families.openvla.lora_flops.openvla_lora_flops` (no weight gradient
        for the frozen base: ~4 x params x tokens), or OpenVLA-OFT's
        (:func:`~parallax.families.openvla.oft_objective.batch_flops`). ``model``: the whole
        model on meta as the run adapts it (without it, every parameter trains)."""
        if config.oft is not None:
            return oft_objective.batch_flops(config, microbatches, cfg.finetune == "lora")
        if cfg.finetune == "lora":
            if model is None:
                raise ValueError("LoRA FLOPs are counted on the adapted whole model: pass it")
            return self._lora_flops(model, microbatches, cfg)
        patch = "vision_backbone.featurizer.patch_embed.proj.weight"
        frozen = model is not None and not model.get_parameter(patch).requires_grad
        return batch_flops(
            config,
            microbatches,
            labelled_logits=cfg.logits == "labelled",
            frozen_vision=frozen,
        )

    def _lora_flops(self, model: nn.Module, microbatches, cfg) -> float:
        """The per-layer costs are found once per adapted model (one forward on meta)."""
        cached = getattr(self, "_lora_costs", None)
        if cached is None or cached[0] is not model:
            cached = self._lora_costs = (model, openvla_linear_costs(model))
        costs = cached[1]
        total = 0.0
        for mb in microbatches:
            b, t = mb["input_ids"].shape
            rows = loss_token_count(mb["labels"]) / b if cfg.logits == "labelled" else None
            total += b * openvla_lora_flops(model, t, rows, costs)
        return total

    def block_estimates(self, config: OpenVLAConfig, cfg) -> list[BlockEstimate]:
        """:func:`parallax.families.openvla.estimate.block_estimates`."""
        return block_estimates(self, config, cfg)

    def tokens(self, config: OpenVLAConfig, microbatches: Sequence[Microbatch]) -> int:
        """The sequence the language model sees, without the padding (tokens/s counts the
        data, not the pads a batch or ``--pad-to-multiple-of`` adds; the FLOPs count all)."""
        total = 0
        for mb in microbatches:
            ids = mb["input_ids"]  # (b, t)
            real = mb.get("attention_mask")  # OFT's; its empty slots hold the pad id
            real = ids != config.pad_token_id if real is None else real
            total += int(real.sum()) + ids.shape[0] * config.prefix_tokens
        return total

"""pi0's model and data sides (:mod:`parallax.families.pi0.recipe` composes them with the
flow-matching objective).

Pipeline blocks (:meth:`Pi0Model.stage_blocks`): the tower, the projector, the embeddings and
the suffix's input heads first, then layer ``i`` of both streams per block, the last with the
output head; every block but the last hands on ``(prefix, suffix, pad[, cond])``. The last
layer's prefix stream after its keys and values and the prefix model's final norm never reach
the actions (:meth:`Pi0Model.unused_names`): they are frozen so that nothing waits for their
gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.families.pi0.batches import Pi0Batches, stage_inputs
from parallax.families.pi0.checkpoint import config_from_folder, load_model, save_policy
from parallax.families.pi0.config import PRESETS, Pi0Config
from parallax.families.pi0.data import IndexedSamples, synthetic_task
from parallax.families.pi0.estimate import block_estimates
from parallax.families.pi0.flops import flops_per_sample
from parallax.families.pi0.model import Pi0Model
from parallax.families.pi0.prompt import find_tokenizer
from parallax.families.pi0.robot_data import robot_dataset
from parallax.families.pi0.stream_data import Pi0Stream, robot_stream, stream_loader
from parallax.models.estimate import BlockEstimate
from parallax.models.stages import StageBlock
from parallax.pipeline import TensorMeta
from parallax.recipe import DataSide, Microbatch, ModelSide, ModelSpec
from parallax.recipe.model_side import init_seed, preset_or_checkpoint
from parallax.run import Run

DEFAULT_LR = {"pi0-tiny": 1e-3, "pi05-tiny": 1e-3}
DEFAULT_LR_LARGE = 2.5e-5  # openpi's fine-tuning peak rate
SUFFIX_HEADS = (
    "action_in_proj",
    "action_out_proj",
    "state_proj",
    "action_time_mlp_in",
    "action_time_mlp_out",
    "time_mlp_in",
    "time_mlp_out",
)


class Pi0Data(DataSide):
    """The synthetic task's pi0 form (:mod:`.data`, random access); LeRobot datasets, LIBERO
    and RLDS, one or a mixture, streamed (:mod:`.stream_data`; ``--eval-data`` one dataset by
    random access, :mod:`.robot_data`); microbatches of :class:`Pi0Batches`."""

    input_keys = ("images", "image_masks", "tokens", "token_mask", "actions", "noise", "time")

    def dataset(self, spec: Any, run: Run) -> Any:
        if spec == "synthetic":
            return IndexedSamples(synthetic_task(run.model_config, run.seed))
        return robot_stream(spec, run)

    def eval_dataset(self, spec: str | None, run: Run) -> Any:
        if spec is None and run.data == "synthetic":
            return IndexedSamples(synthetic_task(run.model_config, run.seed + 1))
        if spec is None:
            return super().eval_dataset(spec, run)
        if spec == "synthetic":
            return IndexedSamples(synthetic_task(run.model_config, run.seed))
        return robot_dataset(spec, run)

    def loader(self, dataset: Any, run: Run, ctx) -> Any:
        if isinstance(dataset, Pi0Stream):
            return stream_loader(dataset, run, ctx)
        return super().loader(dataset, run, ctx)

    def collator(self, run: Run, dataset: Any):
        stats = dataset.statistics
        tokenizer = find_tokenizer(run.family_options.tokenizer, run.checkpoint)
        first = next(iter(stats.values()))
        return Pi0Batches(run.model_config, first, run.seed, tokenizer, by_dataset=stats)

    def stage_inputs(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        return stage_inputs(mb)

    def stage_metas(self, run: Run, mb: Microbatch, dtype) -> list[TensorMeta]:
        """``(prefix, suffix, pad[, cond])``: what every block but the last hands on."""
        c: Pi0Config = run.model_config
        b = mb["tokens"].shape[0]
        p, s = c.prefix_length, c.suffix_length
        metas = [
            TensorMeta((b, p, c.prefix.width), dtype, True),
            TensorMeta((b, s, c.expert.width), dtype, True),
            TensorMeta((b, p), torch.bool, False),
        ]
        return metas + ([TensorMeta((b, c.expert.width), dtype, True)] if c.pi05 else [])


class Pi0Side(ModelSide):
    """The tower, the projector, both Gemma streams and the heads: one block."""

    freeze_aliases = {"vision": ("vision.*",)}
    pin_first = 0
    lora_exclude = ("action_in_proj", "action_out_proj")

    def presets(self) -> Sequence[str]:
        return tuple(PRESETS)

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        return config_json.get("type") in ("pi0", "pi05")

    def resolve(self, spec: str) -> ModelSpec:
        if spec in PRESETS:
            return ModelSpec(Pi0Config.preset(spec))
        path = Path(spec)
        if path.is_dir() and (path / "config.json").is_file():
            return ModelSpec(config_from_folder(path), path)
        return preset_or_checkpoint(spec, Pi0Config, "a pi0 preset", sorted(PRESETS))

    def default_lr(self, spec: str) -> float:
        return DEFAULT_LR.get(spec, DEFAULT_LR_LARGE)

    def fully_trained(self, run: Run) -> tuple[str, ...]:
        """Beside LoRA's adapters the suffix heads and pi0.5's adaptive norms train whole (new
        modules of the action expert, no adapters on plain linears)."""
        return SUFFIX_HEADS + ("*.dense",) if run.model_config.pi05 else SUFFIX_HEADS

    def check_layout(self, run: Run, dims) -> None:
        heads = run.model_config.prefix.heads
        if heads % dims.tp:
            raise ValueError(f"--tp {dims.tp} does not divide the Gemma streams' {heads} heads")

    def blocks(self, config: Pi0Config) -> list[StageBlock]:
        return Pi0Model.stage_blocks(config)

    def build(self, run, blocks, ctx, *, dtype, device, checkpoint) -> nn.Module:
        if checkpoint is not None:
            model = load_model(checkpoint, ctx, blocks=blocks, dtype=dtype, device=device)
        else:
            seed = init_seed(run, device)
            kw = dict(blocks=blocks, dtype=dtype, device=device, seed=seed)
            model = Pi0Model(run.model_config, ctx, **kw)
        for name in model.unused_names():
            model.get_parameter(name).requires_grad_(False)
        model.set_activation_checkpointing(run.checkpointing)
        return model

    def export(self, run: Run, chunk: Pi0Model, path: Path, statistics: Mapping | None) -> None:
        """LeRobot's policy folder (:func:`~.checkpoint.save_policy`), with the processor files
        of the statistics the run normalised by (:mod:`.processors`)."""
        entry = next(iter(statistics.values())) if statistics else None
        save_policy(chunk, path, chunk.ctx, statistics=entry)

    def flops(self, run: Run, microbatches: Sequence[Microbatch], model=None) -> float:
        b = sum(mb["actions"].shape[0] for mb in microbatches)
        return b * flops_per_sample(run.model_config)

    def block_estimates(self, run: Run) -> list[BlockEstimate]:
        return block_estimates(run.model_config, run)

    def tokens(self, run: Run, microbatches: Sequence[Microbatch]) -> int:
        c: Pi0Config = run.model_config
        total = 0
        for mb in microbatches:
            b = mb["tokens"].shape[0]
            real = int(mb["image_masks"].sum()) * c.image_tokens + int(mb["token_mask"].sum())
            total += real + b * c.suffix_length
        return total

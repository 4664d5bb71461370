"""A recipe's model side: what the model is, how this rank's chunk is built, what it costs.

A family writes three methods (``resolve``, ``blocks``, ``build``) and overrides what differs
from the defaults here. Every hook that takes ``run`` receives the resolved
:class:`~parallax.run.Run`: the options with the family's defaults filled in, its own options
(``run.family_options``), ``run.model_config`` and ``run.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.dims import ParallelDims
from parallax.models.estimate import BlockEstimate, Part
from parallax.models.stages import StageBlock
from parallax.run import Run

Microbatch = dict[str, Any]  # host tensors (and anything else the recipe puts there)


@dataclass
class ModelSpec:
    """What ``--model`` resolved to: the family's config and the checkpoint to read, if any."""

    config: Any
    checkpoint: Path | None = None


def preset_or_checkpoint(
    spec: str,
    config_cls: Any,
    preset: str,
    names: Iterable[str],
    directory: str = "a checkpoint directory",
) -> ModelSpec:
    """``spec`` as a preset of ``config_cls`` (a family's config: ``PRESETS``, ``preset``,
    ``from_pretrained``) or a checkpoint directory with a config.json; else a ``ValueError``
    that lists the preset ``names`` (``preset``, ``directory``: what the family calls them)."""
    if spec in config_cls.PRESETS:
        return ModelSpec(config_cls.preset(spec))
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSpec(config_cls.from_pretrained(path), path)
    raise ValueError(
        f"--model {spec!r} is neither {preset} ({', '.join(names)}) nor {directory} with a "
        "config.json"
    )


def init_seed(run: Run, device: torch.device | str) -> int | None:
    """The seed of a chunk's layout-free init; ``None`` on the meta device (shapes only)."""
    return None if torch.device(device).type == "meta" else run.seed


def vlm_chunk(model_cls, run: Run, blocks, ctx, *, dtype, device, checkpoint, **read) -> nn.Module:
    """:meth:`ModelSide.build` of a vision-language family (its chunk a ``model_cls``, a
    :class:`~parallax.models.vlm.VisionLanguageModel`): read from ``checkpoint`` (``read``: the
    family's reader options) or the layout-free init of ``run.seed``; with ``--logits
    labelled`` it hands the hidden states to the loss, which applies the head to the labelled
    rows."""
    kw = dict(blocks=blocks, activation_checkpointing=run.checkpointing)
    config = run.model_config
    if checkpoint is not None:
        chunk = model_cls.from_pretrained(
            checkpoint, ctx, dtype=dtype, device=device, config=config, **read, **kw
        )
    else:
        seed = init_seed(run, device)
        chunk = model_cls(config, ctx, dtype=dtype, device=device, seed=seed, **kw)
    chunk.return_hidden = run.logits == "labelled"
    return chunk


class ModelSide:
    """The model of a family; see the module docstring. Class attributes are its constants."""

    # ``--freeze-<alias>`` and ``--freeze <alias>`` stand for these globs of global names
    freeze_aliases: Mapping[str, tuple[str, ...]] = {}
    # the block that must open the first stage (pin_first) when a pipeline splits the model
    pin_first: int = 1
    # last name parts of the linears ``--lora-targets all-linear`` leaves alone (output heads)
    lora_exclude: tuple[str, ...] = ("lm_head",)
    # the linears --fp8 leaves in the model's dtype (the output head: parallax.tensor.fp8_apply)
    fp8_exclude: tuple[str, ...] = ("lm_head",)

    # -- what a family must say ------------------------------------------------------------------
    def resolve(self, spec: str) -> ModelSpec:
        """A preset name or a checkpoint directory -> the config (and the checkpoint)."""
        raise NotImplementedError

    def blocks(self, config: Any) -> list[StageBlock]:
        """The ordered pipeline blocks, each with its forward FLOPs per sample as cost."""
        raise NotImplementedError

    def build(
        self,
        run: Run,
        blocks: range,
        ctx: ParallelContext,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        checkpoint: Path | None,
    ) -> nn.Module:
        """This rank's chunk of ``blocks`` of ``run.model_config``: from the layout-free init of
        ``run.seed`` or from ``checkpoint`` (reading only this rank's slices), with the run's
        options (activation checkpointing) applied; on the ``meta`` device, shapes only (no
        init, no reads). Parameter names must be global and layout-free."""
        raise NotImplementedError

    # -- optional ----------------------------------------------------------------------------------
    def presets(self) -> Sequence[str]:
        """Preset names ``--model`` accepts."""
        return ()

    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        """Whether a checkpoint with this ``config.json`` belongs to the family."""
        return False

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

    def configure(self, run: Run) -> Any:
        """``run.model_config`` (as resolved) with the run's options applied (e.g. fused
        projections)."""
        return run.model_config

    def check_layout(self, run: Run, dims: ParallelDims) -> None:
        """Raise ``ValueError`` for a layout the family cannot run (same verdict on every rank:
        it sees only the run and the dims)."""

    def resume_problem(self, run: Run, saved: Mapping[str, Any]) -> str | None:
        """Why ``run`` cannot resume a checkpoint whose run had the options ``saved`` (its
        ``config``), in the family's words (a head or chunk that differs), or None."""
        return None

    def fully_trained(self, run: Run) -> tuple[str, ...]:
        """Module globs of this run's new modules that train whole beside LoRA's adapters
        (``--train`` without being asked; OpenVLA-OFT's head) and that the family's export
        writes apart from the PEFT adapter; none by default."""
        return ()

    def export(self, run: Run, chunk: nn.Module, path: Path, statistics: Mapping | None) -> None:
        """Write the chunk's part of the HF checkpoint (collective over the whole world), with
        the training data's ``statistics`` where the family keeps them."""
        raise ValueError("--export-hf: this family has no export")

    # -- costs -------------------------------------------------------------------------------------
    def flops(
        self, run: Run, microbatches: Sequence[Microbatch], model: nn.Module | None = None
    ) -> float:
        """Model FLOPs of these microbatches' training step (formula in the family's docs).
        ``model``: the whole model on the meta device as the run adapts it (LoRA adapters,
        frozen parameters: ``requires_grad``), for what trains and what does not."""
        return 0.0

    def block_estimates(self, run: Run) -> list[BlockEstimate]:
        """Per pipeline block (in ``blocks()`` order), what one sample keeps for the backward
        and computes (:mod:`parallax.models.estimate`): ``--dry-run`` and the planner
        (:mod:`parallax.plan`) build their activation memory and step time from it. Default:
        each block's cost as matmul FLOPs and no activations (a family should say more)."""
        blocks = self.blocks(run.model_config)
        return [BlockEstimate((Part(b.name, gemm_flops=b.cost),)) for b in blocks]

    def tokens(self, run: Run, microbatches: Sequence[Microbatch]) -> int:
        """Tokens these microbatches process (for tokens/s): image and text tokens."""
        return 0

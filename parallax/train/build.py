"""This rank's share of the model, built for the :class:`~parallax.train.trainer.Trainer`.

First the whole model on the meta device (shapes and names only, the same on every rank, no
collective), against which the run's globs are checked (--freeze, LoRA targets, lr groups); then
the chunks of the stages this pipeline rank holds, built through the recipe with the adapters,
frozen parameters and compilation applied before the optimizer sees them.
"""

from __future__ import annotations

from typing import Any

import torch

from parallax.pipeline import PipelineStage
from parallax.recipe.protocol import Recipe, whole_model
from parallax.train import groups, lora
from parallax.train.run import Run


def checked_whole_model(
    recipe: Recipe, model_config: Any, cfg: Run, dtype: torch.dtype
) -> tuple[torch.nn.Module, Any]:
    """The whole model (meta: shapes only) as this run adapts it (adapters, frozen parameters),
    and its LoRA report (None for full fine-tuning); the run's globs are checked on the way."""
    whole = whole_model(recipe, model_config, cfg, dtype)
    groups.check_freeze_globs(cfg, recipe, [n for n, _ in whole.named_parameters()])
    # the whole model's LoRA report (its globs checked; None for full fine-tuning)
    report = lora.check_globs(whole, cfg, recipe)
    groups.apply_freeze([whole], cfg, recipe)
    if cfg.lr_groups:  # against every name that can train, adapters included
        groups.check_lr_group_globs(cfg, [n for n, _ in whole.named_parameters()])
    return whole, report


def build_stages(
    trainer, given_compile_options: dict | None
) -> tuple[list[torch.nn.Module], list[PipelineStage]]:
    """The chunks of the stages ``trainer``'s pipeline rank holds, and their stages."""
    cfg, ctx, recipe = trainer.cfg, trainer.ctx, trainer.recipe
    chunks: list[torch.nn.Module] = []
    stages: list[PipelineStage] = []
    for s, rng in enumerate(trainer.ranges):
        if trainer.schedule.rank_of(s) != ctx.pp_rank:
            continue
        chunk = recipe.build(
            trainer.model_config,
            rng,
            ctx,
            cfg=cfg,
            dtype=trainer.dtype,
            device=ctx.device,
            checkpoint=trainer.checkpoint_dir,
        )
        lora.prepare(chunk, cfg, recipe)  # adapters, frozen base: before the optimizer
        groups.apply_freeze([chunk], cfg, recipe)
        if cfg.compile:
            chunk.compile_blocks(**compile_options(cfg, given_compile_options))
        chunks.append(chunk)
        stages.append(PipelineStage(chunk, s, len(trainer.ranges), ctx))
    return chunks, stages


def compile_options(cfg: Run, given: dict | None) -> dict:
    """``torch.compile`` options: those given, and with ``cuda_graphs`` the inductor's
    reduce-overhead mode (other backends take no mode; on the CPU inductor ignores it)."""
    options = dict(given or {})
    if cfg.cuda_graphs and options.get("backend", "inductor") == "inductor":
        options.setdefault("mode", "reduce-overhead")
    return options

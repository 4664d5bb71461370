"""This rank's share of the model, built for the :class:`~parallax.train.trainer.Trainer`: the
chunks of the stages this pipeline rank holds, each built and adapted as the run says
(:func:`parallax.recipe.adapt.build_chunk`: adapters, frozen parameters) and compiled, before
the optimizer sees them."""

from __future__ import annotations

import torch

from parallax.pipeline import PipelineStage
from parallax.recipe.adapt import build_chunk
from parallax.run import Run


def build_stages(
    trainer, given_compile_options: dict | None
) -> tuple[list[torch.nn.Module], list[PipelineStage]]:
    """The chunks of the stages ``trainer``'s pipeline rank holds, and their stages."""
    run, ctx = trainer.run, trainer.ctx
    chunks: list[torch.nn.Module] = []
    stages: list[PipelineStage] = []
    for s, rng in enumerate(trainer.ranges):
        if trainer.schedule.rank_of(s) != ctx.pp_rank:
            continue
        chunk, _ = build_chunk(
            run, rng, ctx, dtype=trainer.dtype, device=ctx.device, checkpoint=run.checkpoint
        )
        if run.compile:
            chunk.compile_blocks(**compile_options(run, given_compile_options))
        chunks.append(chunk)
        stages.append(PipelineStage(chunk, s, len(trainer.ranges), ctx))
    return chunks, stages


def compile_options(run: Run, given: dict | None) -> dict:
    """``torch.compile`` options: those given, and with ``cuda_graphs`` the inductor's
    reduce-overhead mode (other backends take no mode; on the CPU inductor ignores it)."""
    options = dict(given or {})
    if run.cuda_graphs and options.get("backend", "inductor") == "inductor":
        options.setdefault("mode", "reduce-overhead")
    return options

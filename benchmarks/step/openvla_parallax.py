"""parallax's rows of the OpenVLA step benchmark: the Trainer's configuration per variant
(:data:`VARIANTS`), its timed steps and, for pipelines, the measured and simulated bubble."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from benchmarks.step.native import Workload, dp_share
from benchmarks.step.openvla_layout import Layout
from benchmarks.step.timing import Measured, time_steps
from benchmarks.tools.common import peak_memory_gib, sync
from parallax.context import ParallelContext
from parallax.recipe import resolve

Batch = dict[str, torch.Tensor]
# parallax's speed options per variant (TrainConfig fields); "opt" is the Trainer's defaults
BASE = dict(
    logits="all",
    fused_projections=False,
    compile=False,
    pipeline_syncs=True,
    overlap_param_gather=False,
)
VARIANTS = {
    "opt": {},
    "base": BASE,
    "opt+compile": dict(compile=True),
    # the all-gather waited for inside step(), to measure the overlap
    "opt/gather-sync": dict(overlap_param_gather=False),
    "opt+compile/gather-sync": dict(compile=True, overlap_param_gather=False),
    # the compiled blocks replayed as CUDA graphs (--cuda-graphs: torch.compile's
    # reduce-overhead mode); the second name is the one run 9ae9773d9a40 recorded
    "opt+compile+cudagraphs": dict(compile=True, cuda_graphs=True),
    "opt+compile/cudagraphs": dict(compile=True, cuda_graphs=True),
    # --fp8 (GPUs with FP8 tensor cores, bf16 only): the linears' GEMMs in FP8; its first loss
    # differs from the reference row's by FP8's rounding, so the row is marked
    "opt+compile+fp8": dict(compile=True, fp8=True),
    "opt+compile+cudagraphs+fp8": dict(compile=True, cuda_graphs=True, fp8=True),
}


def parallax_config(
    layout: Layout, wl: Workload, model: str, global_batch: int, variant: str = "opt"
):
    """The :class:`~parallax.train.config.TrainConfig` of the parallax rows of ``variant``
    (:data:`VARIANTS`: ``base`` turns every speed option off)."""
    from parallax.run import TrainConfig

    cfg = TrainConfig(
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        model=model,
        precision="bf16" if wl.autocast is not None else "fp32",
        global_batch_size=global_batch,
        micro_batch_size=wl.micro_batch,
        schedule="1f1b",
        chunks=1,
        lr=wl.lr,
        lr_schedule="constant",
        warmup_steps=0,
        weight_decay=wl.weight_decay,
        grad_clip=wl.grad_clip,
        overlap_grad_reduce=True,
        activation_checkpointing=wl.activation_checkpointing,
        seed=wl.seed,
        **VARIANTS[variant],
    )
    cfg.check()
    return cfg


def run_parallax(
    layout: Layout,
    wl: Workload,
    ctx: ParallelContext,
    model: str,
    microbatches: Sequence[Batch],
    warmup: int,
    steps: int,
    variant: str = "opt",
    compile_backend: str = "inductor",
) -> Measured:
    """parallax's Trainer on this layout; for pp, one more step recorded on a Timeline gives
    the measured bubble and the simulated one (the schedule fed the measured stage times).
    Labels stay on the host, as the data loader gives them: the Trainer reads the labelled
    positions from them without a device synchronisation."""
    from parallax.train.trainer import Trainer

    cfg = parallax_config(layout, wl, model, len(microbatches) * wl.micro_batch, variant)
    trainer = Trainer(resolve(cfg), ctx, compile_options={"backend": compile_backend})
    mine = dp_share(microbatches, trainer.ctx.dp_rank, trainer.ctx.dp_size)
    mine = [{**mb, "labels": mb["labels"].cpu()} for mb in mine]
    times, first, loss = time_steps(lambda: trainer.train_step(mine), ctx.device, warmup, steps)
    measured = Measured(times, peak_memory_gib(ctx.device), loss, first)
    if layout.pp > 1:
        measured.extra.update(pipeline_bubbles(trainer, mine))
    return measured


def pipeline_bubbles(trainer, microbatches: Sequence[Batch]) -> dict[str, float]:
    """Measured and simulated bubble of one recorded step (on global rank 0)."""
    from benchmarks.pipeline.bubble import measured_costs
    from parallax.pipeline import (
        Timeline,
        gather_events,
        measured_bubble,
        simulate,
    )

    timeline = Timeline()
    trainer.train_step(microbatches, timeline=timeline)
    sync(trainer.ctx.device)
    events = gather_events(timeline, trainer.ctx)
    if events is None:
        return {}
    schedule = trainer.schedule
    fwd, bwd = measured_costs(events, schedule.num_stages)
    return {
        "bubble_measured": measured_bubble(events),
        "bubble_simulated": simulate(schedule, fwd, bwd).bubble_fraction,
    }

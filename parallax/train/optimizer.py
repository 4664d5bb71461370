"""The Trainer's optimizer: ZeRO AdamW (``--zero 1|2|3``) over the trainable parameters of this
rank's chunks, grouped by learning rate and weight decay (:mod:`parallax.run.param_groups`),
with as many backward passes per step as the recipe runs. At ``--zero 3`` it also shards the chunks'
frozen weights (a LoRA run's base) and gathers each block around its use."""

from __future__ import annotations

import logging

import torch

from parallax.optim import ZeroOptimizer
from parallax.run import param_groups as groups

log = logging.getLogger(__name__)


def build_optimizer(trainer) -> ZeroOptimizer:
    """The run's ZeRO AdamW over this rank's trainable parameters, in their groups."""
    named = [(n, p) for n, p in trainer._named_parameters() if p.requires_grad]
    passes = trainer.recipe.objective.backward_passes(trainer.num_microbatches)
    run = trainer.run
    if run.host_adamw == "one-pass" and (run.offload == "none" or not run.host_step_one_pass):
        why = "nothing is offloaded" if run.offload == "none" else "unclipped, the backward steps"
        log.warning("--host-adamw %s changes nothing here: %s", run.host_adamw, why)
    masters = run.host_masters_kind(trainer.ctx.device.type)
    if run.host_masters == "split" and masters != "split":
        log.warning("--host-masters split changes nothing here: the one-pass AdamW does not step")
    kwargs = {}
    if trainer.ctx.device.type == "cuda":
        kwargs["fused"] = True  # one kernel for the whole fp32 shard (offloaded: the CPU's)
    return ZeroOptimizer(
        groups.param_groups(named, trainer.run),
        torch.optim.AdamW,
        trainer.ctx,
        stage=trainer.run.zero,
        modules=trainer.chunks,
        reshard_after_forward=trainer.run.reshard_after_forward,
        offload=trainer.run.offload == "optimizer",
        offload_fraction=trainer.run.offload_fraction,
        gpu_accumulation=trainer.run.gpu_accumulation,
        host_adamw=run.host_kernel(trainer.ctx.device.type),  # (unclipped: nothing to compile)
        host_masters=masters,
        # nothing clips after the backward: the host steps each bucket during it
        step_in_backward=not trainer.run.grad_clip,
        overlap=trainer.run.overlap_grad_reduce,
        backward_passes_per_step=passes,
        param_order=[p for _, p in named],
        # a CUDA graph's gradient outputs live in its memory pool, which the next replay
        # on the compute stream may overwrite: copy them out on that stream
        side_stream_grad_copies=not trainer.run.cuda_graphs,
        lr=trainer.run.lr,
        weight_decay=trainer.run.weight_decay,
        **kwargs,
    )

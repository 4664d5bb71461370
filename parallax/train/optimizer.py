"""The Trainer's optimizer: ZeRO AdamW (``--zero 1|2|3``) over the trainable parameters of this
rank's chunks, grouped by learning rate and weight decay (:mod:`parallax.train.groups`), with as
many backward passes per step as the recipe runs. At ``--zero 3`` it also shards the chunks'
frozen weights (a LoRA run's base) and gathers each block around its use."""

from __future__ import annotations

import torch

from parallax.optim import ZeroOptimizer
from parallax.train import groups


def build_optimizer(trainer) -> ZeroOptimizer:
    """The run's ZeRO AdamW over this rank's trainable parameters, in their groups."""
    named = [(n, p) for n, p in trainer._named_parameters() if p.requires_grad]
    kwargs = {}
    if trainer.ctx.device.type == "cuda":
        kwargs["fused"] = True  # one kernel for the whole fp32 shard (offloaded: the CPU's)
    return ZeroOptimizer(
        groups.param_groups(named, trainer.cfg),
        torch.optim.AdamW,
        trainer.ctx,
        stage=trainer.cfg.zero,
        modules=trainer.chunks,
        reshard_after_forward=trainer.cfg.reshard_after_forward,
        offload=trainer.cfg.offload == "optimizer",
        offload_fraction=trainer.cfg.offload_fraction,
        # nothing clips after the backward: the host steps each bucket during it
        step_in_backward=not trainer.cfg.grad_clip,
        overlap=trainer.cfg.overlap_grad_reduce,
        backward_passes_per_step=trainer.recipe.backward_passes(trainer.num_microbatches),
        param_order=[p for _, p in named],
        # a CUDA graph's gradient outputs live in its memory pool, which the next replay
        # on the compute stream may overwrite: copy them out on that stream
        side_stream_grad_copies=not trainer.cfg.cuda_graphs,
        lr=trainer.cfg.lr,
        weight_decay=trainer.cfg.weight_decay,
        **kwargs,
    )

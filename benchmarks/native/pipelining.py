"""``torch.distributed.pipelining`` with ``Schedule1F1B`` on the same OpenVLA stage split.

Every rank is one stage, built with :func:`~benchmarks.native.base.stage_ranges` (OpenVLA's
cost-balanced split: both towers, the projector and the embedding on stage 0). Precision: fp32
parameters under ``torch.autocast(bf16)``, the same policy as the other natives; torch's
pipelining has no master-weight machinery of its own, so bf16 parameters with fp32 masters would
be parallax's scheme, not PyTorch's. Under autocast the residual stream stays fp32 (bf16 matmul
outputs are added to fp32 embeddings), so the activations sent between stages are fp32.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist

from benchmarks.native.base import (
    Batch,
    Runner,
    Workload,
    autocast,
    cat_batches,
    clip_grad_norm,
    dense_openvla,
    loss_of,
    make_adamw,
    stage_ranges,
)


def _stage_kwargs(stage_cls, wl: Workload, rank: int, example: Batch, device) -> dict:
    """Example inputs for torch < 2.6, whose ``PipelineStage`` cannot infer shapes itself."""
    if inspect.signature(stage_cls.__init__).parameters["input_args"].default is not (
        inspect.Parameter.empty
    ):
        return {}
    if rank == 0:
        return {"input_args": (example["pixel_values"], example["input_ids"])}
    b, t = example["input_ids"].shape
    hidden = torch.empty(b, wl.config.num_patches + t, wl.config.text.hidden_size, device=device)
    return {"input_args": (hidden,)}


def build_pipelining(
    wl: Workload, device: torch.device, num_microbatches: int, example: Batch
) -> Runner:
    """One stage per rank, 1F1B over ``num_microbatches``; AdamW on each stage's parameters and
    the gradient norm summed over the stages. ``example`` is one micro-batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp, rank = dist.get_world_size(), dist.get_rank()
    model = dense_openvla(wl, device, blocks=stage_ranges(wl.config, pp)[rank])
    stage = PipelineStage(
        model, rank, pp, device, **_stage_kwargs(PipelineStage, wl, rank, example, device)
    )
    m = num_microbatches

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_of(wl.config, logits, labels) / m  # summed over micro-batches: the mean

    extra = {}
    if "scale_grads" in inspect.signature(Schedule1F1B.__init__).parameters:
        extra["scale_grads"] = False  # the loss is already divided by m (older torch: never)
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn, **extra)
    opt = make_adamw(model.named_parameters(), wl)
    first, last = rank == 0, rank == pp - 1

    def step(microbatches: Sequence[Batch]) -> dict[str, torch.Tensor]:
        if len(microbatches) != m:
            raise ValueError(
                f"the 1F1B schedule was built for {m} micro-batches, got {len(microbatches)}"
            )
        opt.zero_grad(set_to_none=True)
        batch = cat_batches(microbatches)
        args = (batch["pixel_values"], batch["input_ids"]) if first else ()
        kwargs = {"target": batch["labels"], "losses": []} if last else {}
        with autocast(wl, device):
            schedule.step(*args, **kwargs)
        loss = torch.zeros((), device=device)
        if last:
            loss = torch.stack([x.detach().float() for x in kwargs["losses"]]).sum()
        norm = clip_grad_norm(model.parameters(), wl.grad_clip, stage_group=dist.group.WORLD)
        opt.step()
        dist.all_reduce(loss)  # the loss lives on the last stage; give it to every rank
        return {"loss": loss, "grad_norm": norm}

    return Runner("torch-pipelining", step, [model], opt)

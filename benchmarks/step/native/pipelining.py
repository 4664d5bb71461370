"""``torch.distributed.pipelining`` with ``Schedule1F1B`` on the same OpenVLA stage split.

Every rank is one stage, built with :func:`~benchmarks.step.native.base.stage_ranges` (OpenVLA's
cost-balanced split: both towers, the projector and the embedding on stage 0). Precision: fp32
parameters under ``torch.autocast(bf16)``, the same policy as the other natives; torch's
pipelining has no master-weight machinery of its own, so bf16 parameters with fp32 masters would
be parallax's scheme, not PyTorch's. Under autocast the residual stream would stay fp32 (bf16
matmul outputs added to fp32 embeddings); each stage but the last therefore casts its output to
``Workload.activation_dtype`` (bf16), so stages send bf16 activations and gradients, as
parallax's bf16 stages do, and the later stages' residual streams are bf16 too.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.step.native.base import (
    Batch,
    MissingAPI,
    Runner,
    Workload,
    autocast,
    cat_batches,
    clip_grad_norm,
    compile_blocks,
    dense_openvla,
    loss_of,
    make_adamw,
    stage_ranges,
)


class CastOutput(nn.Module):
    """A pipeline stage whose output is sent as ``dtype`` (its gradient comes back in it)."""

    def __init__(self, stage: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.stage, self.dtype = stage, dtype

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.stage(*inputs).to(self.dtype)


def _stage_kwargs(stage_cls, wl: Workload, rank: int, example: Batch, device) -> dict:
    """Example inputs for torch < 2.6, whose ``PipelineStage`` cannot infer shapes itself."""
    if inspect.signature(stage_cls.__init__).parameters["input_args"].default is not (
        inspect.Parameter.empty
    ):
        return {}
    if rank == 0:
        return {"input_args": (example["pixel_values"], example["input_ids"])}
    b, t = example["input_ids"].shape
    shape = (b, wl.config.num_patches + t, wl.config.text.hidden_size)
    hidden = torch.empty(shape, dtype=wl.activation_dtype, device=device)
    return {"input_args": (hidden,)}


def build_pipelining(
    wl: Workload, device: torch.device, num_microbatches: int, example: Batch
) -> Runner:
    """One stage per rank, 1F1B over ``num_microbatches``, activations between stages in
    ``wl.activation_dtype``, blocks compiled with ``wl.compile_backend``; AdamW on each stage's
    parameters and the gradient norm summed over the stages. ``example`` is one micro-batch."""
    try:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    except ImportError as err:
        raise MissingAPI(f"torch {torch.__version__} has no torch.distributed.pipelining") from err

    pp, rank = dist.get_world_size(), dist.get_rank()
    model = compile_blocks(dense_openvla(wl, device, blocks=stage_ranges(wl.config, pp)[rank]), wl)
    first, last = rank == 0, rank == pp - 1
    module = model if last else CastOutput(model, wl.activation_dtype)
    stage = PipelineStage(
        module, rank, pp, device, **_stage_kwargs(PipelineStage, wl, rank, example, device)
    )
    m = num_microbatches

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_of(wl.config, logits, labels) / m  # summed over micro-batches: the mean

    extra = {}
    if "scale_grads" in inspect.signature(Schedule1F1B.__init__).parameters:
        extra["scale_grads"] = False  # the loss is already divided by m (older torch: never)
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn, **extra)
    opt = make_adamw(model.named_parameters(), wl)

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

"""Baselines that replicate or shard the whole model over data parallelism: one device,
DDP + ``ZeroRedundancyOptimizer(AdamW)``, and FSDP2 ``fully_shard`` per block.

Each ``build_*`` returns a :class:`Runner` whose ``step(microbatches)`` takes the *global*
batch's micro-batches (the same list on every rank), trains on this rank's share with gradient
accumulation, clips, steps, and returns ``{"loss", "grad_norm"}`` as tensors (no host sync).
Every data-parallel baseline reduces gradients once per step, in the last micro-batch's
backward (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)`` before it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from benchmarks.step.native.base import (
    Batch,
    MissingAPI,
    Runner,
    Workload,
    accumulate,
    adamw,
    clip_grad_norm,
    compile_blocks,
    dense_openvla,
    dp_share,
    make_adamw,
)


def build_single(wl: Workload, device: torch.device) -> Runner:
    """The plain single-device loop: fp32 parameters, autocast, AdamW."""
    model = compile_blocks(dense_openvla(wl, device), wl)
    opt = make_adamw(model.named_parameters(), wl)

    def step(microbatches: Sequence[Batch]) -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        loss = accumulate(wl, model, microbatches, device)
        norm = clip_grad_norm(model.parameters(), wl.grad_clip)
        opt.step()
        return {"loss": loss, "grad_norm": norm}

    return Runner("torch-single", step, [model], opt)


def build_ddp_zero(wl: Workload, device: torch.device) -> Runner:
    """DDP (gradients as bucket views: no second copy) + ZeroRedundancyOptimizer(AdamW): each
    rank steps the AdamW state of its share of the parameters, then broadcasts them."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = compile_blocks(dense_openvla(wl, device), wl)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        bucket_cap_mb=100,
    )
    groups, kwargs = adamw(model.named_parameters(), wl)
    opt = ZeroRedundancyOptimizer(
        groups,
        optimizer_class=torch.optim.AdamW,
        parameters_as_bucket_view=True,  # one broadcast per rank's shard, not per tensor
        **kwargs,
    )

    def step(microbatches: Sequence[Batch]) -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        mine = dp_share(microbatches, rank, world)
        loss = accumulate(wl, ddp, mine, device, no_sync=ddp.no_sync)
        norm = clip_grad_norm(model.parameters(), wl.grad_clip)  # gradients are all-reduced
        opt.step()
        dist.all_reduce(loss)
        return {"loss": loss / world, "grad_norm": norm}

    return Runner("torch-ddp-zero", step, [ddp, model], opt)


def fsdp_api():
    """``(fully_shard, MixedPrecisionPolicy)``: public from torch 2.6, ``_composable`` before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError as err:
            raise MissingAPI(f"torch {torch.__version__} has no FSDP2 fully_shard") from err
    return fully_shard, MixedPrecisionPolicy


@contextmanager
def fsdp_no_sync(model, keep_unsharded: bool) -> Iterator[None]:
    """FSDP2's gradient accumulation without communication: inside, a backward leaves each
    unit's unsharded gradient in place (no reduce-scatter) and, with ``keep_unsharded``, its
    parameters gathered (no second all-gather in the next micro-batch's forward and backward,
    at the cost of the whole model's bf16 weights on every rank)."""
    model.set_requires_gradient_sync(False)
    if keep_unsharded:
        model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        if keep_unsharded:
            model.set_reshard_after_backward(True)


def build_fsdp2(wl: Workload, device: torch.device) -> Runner:
    """FSDP2: every ViT block and decoder layer its own unit (compiled with
    ``wl.compile_backend``), the rest in the root; fp32 shards, bf16 compute, one fp32
    gradient reduce-scatter per step (the micro-batches before the last accumulate unsharded
    gradients, :func:`fsdp_no_sync`)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, MixedPrecisionPolicy = fsdp_api()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=wl.autocast, reduce_dtype=torch.float32)
        if wl.autocast is not None
        else MixedPrecisionPolicy()
    )
    keep = wl.fsdp_unsharded_accumulation
    model = dense_openvla(wl, device)
    vision = model.vision_backbone
    for block in [*vision.featurizer.blocks.values(), *vision.fused_featurizer.blocks.values()]:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    for layer in model.language_model.model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    needs = ["set_requires_gradient_sync"] + ["set_reshard_after_backward"] * keep
    for name in needs:
        if not hasattr(model, name):
            raise MissingAPI(f"torch {torch.__version__}'s FSDP2 has no {name}")
    compile_blocks(model, wl)  # FSDP2's hooks stay eager (torch keeps them out of the graphs)
    opt = make_adamw(model.named_parameters(), wl)
    plain = replace(wl, autocast=None)  # FSDP2 casts the parameters; no autocast on top

    def step(microbatches: Sequence[Batch]) -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        mine = dp_share(microbatches, rank, world)
        loss = accumulate(plain, model, mine, device, no_sync=lambda: fsdp_no_sync(model, keep))
        norm = clip_grad_norm(model.parameters(), wl.grad_clip, shard_group=mesh.get_group())
        opt.step()
        dist.all_reduce(loss)
        return {"loss": loss / world, "grad_norm": norm}

    return Runner("torch-fsdp2", step, [model], opt)

"""The PyTorch-native peer of ``memory_fit``: torch FSDP2 with its CPU offload.

``fully_shard`` per ViT block and decoder layer, bf16 mixed precision (fp32 reduction),
``CPUOffloadPolicy`` (fp32 parameters, gradients and AdamW state in pinned host memory; the
optimizer steps on the CPU), activation checkpointing per block (the model's own), fused
AdamW. The model is built on the host (its fp32 parameters are where the policy keeps them),
one process, world size 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.step.native.base import (
    Workload,
    accumulate,
    dense_openvla,
    make_adamw,
    split_batch,
    synthetic_batch,
)
from benchmarks.step.native.data_parallel import fsdp_api
from benchmarks.tools.common import median, time_it
from parallax.families.openvla import OpenVLAConfig

TEXT_TOKENS, LABELLED = 40, 8  # openvla_step's workload: BOS + 39 prompt tokens, 8 labelled


def build(config: OpenVLAConfig, micro_batch: int, device: torch.device) -> Callable:
    """The step function of FSDP2 + CPUOffloadPolicy on this one device."""
    from torch.distributed.fsdp import CPUOffloadPolicy  # torch >= 2.6

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, MixedPrecisionPolicy = fsdp_api()
    mesh = init_device_mesh("cuda", (1,))
    wl = Workload(config=config, micro_batch=micro_batch, activation_checkpointing=True)
    model = dense_openvla(wl, torch.device("cpu"))  # fp32, on the host where the policy keeps it
    vision, text = model.vision_backbone, model.language_model.model
    kw = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(pin_memory=True),
    )
    for blocks in (vision.featurizer.blocks, vision.fused_featurizer.blocks, text.layers):
        for block in blocks.values():
            fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = make_adamw(model.named_parameters(), wl)  # fused: its CPU kernel steps the host state
    plain = Workload(config=config, micro_batch=micro_batch, autocast=None)  # FSDP2 casts

    def step(microbatches) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = accumulate(plain, model, microbatches, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return step


def measure(config: OpenVLAConfig, batch: int, micro_batch: int, steps: int, warmup: int) -> dict:
    """Median step seconds and peak allocated GiB of the peer at ``batch`` samples a step."""
    device = torch.device("cuda")
    step = build(config, micro_batch, device)
    data = synthetic_batch(config, batch, TEXT_TOKENS, LABELLED, device=device)
    microbatches = split_batch(data, micro_batch)
    times = time_it(lambda: step(microbatches).item(), device, warmup, steps)
    return dict(
        step_s=median(times),
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
    )

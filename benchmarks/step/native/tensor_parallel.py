"""DTensor tensor parallelism (``ColwiseParallel`` / ``RowwiseParallel``) on the same OpenVLA.

The plan is Megatron's: q/k/v, gate/up, ViT qkv and fc1, projector fc1 column-wise; o, down, ViT
proj and fc2, projector fc2 and fc3 row-wise; the token embedding row-wise over the vocabulary
and the lm_head column-wise with its logits left sharded over the vocabulary (``Shard(-1)``): the
cross-entropy runs under ``loss_parallel`` (each rank its slice of the softmax, two small
all-reduces per row) instead of gathering the full ``(b, s, V)`` logits. Norms, patch
embeddings and LayerScale stay replicated plain parameters.

The ViT's fused qkv weight is ``[q; k; v]``: a contiguous column split would give a rank all of
q and half of k. Its rows are therefore reordered once to ``[q_0 k_0 v_0 | q_1 k_1 v_1 ...]``
(rank r's heads of each), so that the plain split hands every rank its own heads, which the
model reshapes with ``-1`` heads. This is the layout parallax's ``partitions=3`` shards use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.step.native.base import (
    IGNORE_INDEX,
    Batch,
    MissingAPI,
    Replicate,
    Runner,
    Shard,
    Workload,
    accumulate,
    clip_grad_norm,
    compile_blocks,
    dense_openvla,
    make_adamw,
)
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.objective import expand_labels


def interleave_qkv(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Rows ``[q; k; v]`` -> ``[q_0 k_0 v_0 | ... | q_{tp-1} k_{tp-1} v_{tp-1}]``."""
    rows = t.shape[0]
    if rows % (3 * tp):
        raise ValueError(f"a fused qkv of {rows} rows does not split into 3 x tp={tp} blocks")
    blocks = t.reshape(3, tp, rows // (3 * tp), *t.shape[1:])  # (3, tp, w/tp, ...)
    return blocks.transpose(0, 1).reshape(t.shape).contiguous()  # (tp, 3, w/tp, ...)


def tp_plan(model: nn.Module) -> dict[str, object]:
    """Module name -> DTensor parallel style for every sharded layer of an OpenVLA."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel, RowwiseParallel
    plan: dict[str, object] = {}
    if hasattr(model, "vision_backbone"):
        for tower in ("featurizer", "fused_featurizer"):
            for i in getattr(model.vision_backbone, tower).blocks:
                name = f"vision_backbone.{tower}.blocks.{i}"
                plan[f"{name}.attn.qkv"], plan[f"{name}.attn.proj"] = col(), row()
                plan[f"{name}.mlp.fc1"], plan[f"{name}.mlp.fc2"] = col(), row()
        plan["projector.fc1"], plan["projector.fc2"] = col(), row()
        plan["projector.fc3"] = row(input_layouts=Replicate())
        plan["language_model.model.embed_tokens"] = row(input_layouts=Replicate())
    for i in model.language_model.model.layers:
        name = f"language_model.model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{name}.self_attn.{proj}"] = col()
        plan[f"{name}.self_attn.o_proj"] = row()
        plan[f"{name}.mlp.gate_proj"], plan[f"{name}.mlp.up_proj"] = col(), col()
        plan[f"{name}.mlp.down_proj"] = row()
    if hasattr(model.language_model, "lm_head"):
        plan["language_model.lm_head"] = col(output_layouts=Shard(-1), use_local_output=False)
    return plan


def loss_parallel_api():
    """``torch.distributed.tensor.parallel.loss_parallel`` (torch >= 2.3)."""
    try:
        from torch.distributed.tensor.parallel import loss_parallel
    except ImportError as err:
        raise MissingAPI(f"torch {torch.__version__} has no loss_parallel") from err
    return loss_parallel


def parallel_loss(config: OpenVLAConfig, logits, labels: torch.Tensor):
    """Mean next-token cross-entropy of vocabulary-sharded DTensor logits ``(b, P + t, V)``
    (``Shard(2)``) over the labelled tokens, as :func:`~benchmarks.step.native.base.loss_of`
    computes it on full logits; call it, and the backward, under ``loss_parallel``."""
    target = expand_labels(labels, config.num_patches)[:, 1:]  # (b, P + t - 1)
    rows = logits[:, :-1].flatten(0, 1).float()  # (n, V), still sharded on the vocabulary
    return F.cross_entropy(rows, target.flatten(), ignore_index=IGNORE_INDEX)


def build_dtensor_tp(wl: Workload, device: torch.device) -> Runner:
    """Tensor parallel over every rank; fp32 parameters (DTensor shards) under autocast, AdamW
    on the shards, the loss vocabulary-parallel, each block compiled with
    ``wl.compile_backend``. Every rank sees the whole global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    loss_parallel = loss_parallel_api()
    tp = dist.get_world_size()
    mesh = init_device_mesh(device.type, (tp,))
    model = dense_openvla(wl, device)
    if model.config.text.fused_projections:
        raise ValueError("the DTensor baseline needs separate q/k/v and gate/up projections")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attn.qkv." in name:
                p.data = interleave_qkv(p.data, tp)
    parallelize_module(model, mesh, tp_plan(model))
    compile_blocks(model, wl)
    opt = make_adamw(model.named_parameters(), wl)
    group = mesh.get_group()

    def step(microbatches: Sequence[Batch]) -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        loss = accumulate(
            wl,
            model,
            microbatches,
            device,
            loss_fn=lambda logits, labels: parallel_loss(wl.config, logits, labels),
            loss_context=loss_parallel,
        )
        norm = clip_grad_norm(model.parameters(), wl.grad_clip, shard_group=group)
        opt.step()
        return {"loss": loss, "grad_norm": norm}

    return Runner("torch-dtensor-tp", step, [model], opt)

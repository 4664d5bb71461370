"""Model FLOPs of an OpenVLA LoRA step, in the convention of :mod:`parallax.models.lora_flops`.

The frozen towers' first products need no input gradient, the adapters add their own; the
costs of each linear are read off one forward pass of the whole model on the meta device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from parallax.families.openvla.config import OpenVLAConfig
from parallax.models.lora_flops import LinearCost, linear_costs, step_flops

TOWERS = ("vision_backbone.featurizer", "vision_backbone.fused_featurizer")


def openvla_linear_costs(model: nn.Module) -> list[LinearCost]:
    """:func:`linear_costs` of a whole OpenVLA (compute once per run: they do not depend on
    the sequence length)."""
    config: OpenVLAConfig = model.config
    dev = next(model.parameters()).device
    s = config.image_size
    px = torch.zeros(1, 6, s, s, device=dev)
    ids = torch.zeros(1, 2, dtype=torch.long, device=dev)
    return linear_costs(model, px, ids)


def openvla_lora_flops(
    model: nn.Module,
    text_tokens: int,
    logit_positions: int | None = None,
    costs: Sequence[LinearCost] | None = None,
) -> float:
    """Step FLOPs of one OpenVLA sample with ``text_tokens`` input ids (BOS included), the
    lm_head over ``logit_positions`` (default: every position), for a whole ``model`` (meta is
    enough) after :func:`~parallax.tensor.lora_apply.apply_lora` and any unfreezing; pass
    ``costs`` (:func:`openvla_linear_costs`) to skip the forward that finds them."""
    config: OpenVLAConfig = model.config
    p, t = config.num_patches, config.text
    seq = p + text_tokens
    positions = seq if logit_positions is None else logit_positions
    costs = costs if costs is not None else openvla_linear_costs(model)
    by_name = {c.name: c for c in costs}
    towers = dict(zip(TOWERS, config.vision))

    def tokens(name: str) -> int:
        for prefix, v in towers.items():
            if name.startswith(prefix + "."):
                return v.num_patches + v.num_prefix_tokens
        if name.startswith("projector."):
            return p
        return positions if name.endswith("lm_head") else seq

    total = step_flops(costs, tokens)
    params = dict(model.named_parameters())
    for prefix, v in towers.items():  # patch convolution and attention products
        n, w = v.num_patches + v.num_prefix_tokens, v.width
        patch = params[f"{prefix}.patch_embed.proj.weight"]
        total += 2 * patch.numel() * v.num_patches * (1 + int(patch.requires_grad))
        for i in range(v.feature_index + 1):
            qkv = by_name[f"{prefix}.blocks.{i}.attn.qkv"]
            total += 4.0 * n * n * w * (3 if qkv.output_grad else 1)
    attention = 2.0 * seq * seq * t.num_attention_heads * t.head_dim  # causal: half the square
    for i in range(t.num_hidden_layers):
        first = f"language_model.model.layers.{i}.self_attn."
        q = by_name[first + ("qkv_proj" if t.fused_projections else "q_proj")]
        total += attention * (3 if q.output_grad else 1)
    return total

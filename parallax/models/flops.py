"""Training FLOPs of the architecture pieces parallax builds (ViT towers, Llama layers).

A component is a set of parameters applied to each of its tokens, plus the attention products.
Per sample, a training step costs forward + backward = 3 x the forward (1 x for a frozen part
that needs no backward): ``3 x (2 x N x T + attention)``. Families add their parts up
(:mod:`parallax.families.openvla.flops`, :mod:`parallax.families.llava_next.flops`).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.models.llama import LlamaConfig
from parallax.models.vit import ViTConfig


@dataclass(frozen=True)
class Component:
    """One part of the model: parameters applied per token, tokens, forward attention FLOPs."""

    params: int
    tokens: int
    attention: float  # forward FLOPs of the score and context products (0 without attention)
    trained: bool = True

    @property
    def flops(self) -> float:
        """Training FLOPs per sample (forward only when not trained)."""
        factor = 3 if self.trained else 1
        return factor * (2 * self.params * self.tokens + self.attention)


def vit_block_params(cfg: ViTConfig) -> int:
    """Parameters of one ViT block (norms, qkv, proj, MLP, LayerScale)."""
    w, f = cfg.width, cfg.mlp_hidden
    qkv = 3 * w * w + (3 * w if cfg.qkv_bias else 0)
    scale = 2 * w if cfg.layer_scale else 0
    return 2 * 2 * w + qkv + (w * w + w) + (w * f + f) + (f * w + w) + scale


def vit_components(cfg: ViTConfig, name: str, trained: bool = True) -> dict[str, Component]:
    """Patch embedding and the blocks that run (up to the feature layer) of one tower."""
    n, w = cfg.num_patches + cfg.num_prefix_tokens, cfg.width
    blocks = cfg.feature_index + 1
    norms = 2 * w * (int(cfg.pre_norm) + int(cfg.final_norm))
    patch = 3 * cfg.patch_size**2 * w + w
    return {
        f"{name}.patch_embed": Component(patch, cfg.num_patches, 0.0, trained),
        f"{name}.blocks": Component(
            blocks * vit_block_params(cfg) + norms, n, blocks * 4.0 * n * n * w, trained
        ),
    }


def llama_layer_params(cfg: LlamaConfig) -> int:
    """Parameters of one decoder layer (two RMSNorms, q/k/v/o, gate/up/down)."""
    h, kv, f = cfg.hidden_size, cfg.kv_heads * cfg.head_dim, cfg.intermediate_size
    return 2 * h + 2 * h * h + 2 * h * kv + 3 * h * f

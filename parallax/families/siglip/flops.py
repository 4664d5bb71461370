"""Model FLOPs of a dual encoder, per image-text pair, in the convention of
:mod:`parallax.train.flops`: 3 x the forward for training (forward and backward, no
recomputation counted), the loss's logits against the global batch included.

Functions of the config, as every family's ``flops`` module is (the config only describes).
"""

from __future__ import annotations

from parallax.families.siglip.config import SiglipConfig


def vision_flops(config: SiglipConfig) -> float:
    """Forward FLOPs per image: patches, blocks and the pooling head (or projection)."""
    v, w = config.vision, config.vision.width
    if config.family == "clip":
        return v.flops() + 2 * w * config.embed_dim
    n = v.num_patches
    head = 2 * w * w + 4 * n * w * w + 4 * n * w + 2 * w * w + 4 * w * v.mlp_hidden
    return v.flops() + head


def text_flops(config: SiglipConfig) -> float:
    """Forward FLOPs per caption: the blocks and the head mapping to the embedding width."""
    return config.text.flops() + 2 * config.text.width * config.embed_dim


def flops_per_sample(config: SiglipConfig, global_batch: int, train: bool = True) -> float:
    """Model FLOPs per image-text pair: both towers, plus the loss's logits against the
    ``global_batch`` embeddings of the other side (sigmoid: one direction; softmax: both),
    times 3 for training (forward and backward; no recomputation counted)."""
    logits = 2 * global_batch * config.embed_dim * (1 if config.loss == "sigmoid" else 2)
    return (3 if train else 1) * (vision_flops(config) + text_flops(config) + logits)

"""A dual encoder's one block as the planner sees it (:mod:`parallax.models.estimate`): per
pair, the image tower (patches, blocks, SigLIP's attention pool or CLIP's class token) and the
text tower over the padded caption. The contrastive loss keeps a few numbers per pair."""

from __future__ import annotations

from parallax.families.siglip.config import SiglipConfig
from parallax.models.estimate import BlockEstimate, Part, Split, embedding, vision_tower, vit_blocks


def block_estimates(config: SiglipConfig, run) -> list[BlockEstimate]:
    e = 2 if run.precision == "bf16" else 4
    v, t = config.vision, config.text
    tokens = v.num_patches + v.num_prefix_tokens
    # SigLIP: the trunk's final LayerNorm (input and output kept), the pool's keys and values
    # (2w/tp) over every token; CLIP: the class token alone after the trunk
    pool = (
        Split(2.0 * tokens * v.width * e, 2.0 * tokens * v.width * e)
        if config.family == "siglip"
        else Split(0.0, 2.0 * v.width * e)
    )
    parts = (
        *vision_tower(v, e),
        Part("image pool", saved=pool, gemm_flops=4.0 * tokens * v.width**2, tokens=tokens),
        embedding(t.max_length, t.width, e),
        vit_blocks(t.block_config(), t.max_length, e, t.depth, "text"),
        Part("text norm", saved=Split(0.0, 2.0 * t.max_length * t.width * e), tokens=t.max_length),
    )
    return [BlockEstimate(parts, 0.0)]

"""The vision towers OpenVLA pairs: the 7B's DINOv2 ViT-L/14 with registers and SigLIP
SO400M, by the timm id a checkpoint's config.json names them with (and their image
normalisation), and the scaled-down pairs of the test presets.
"""

from __future__ import annotations

from dataclasses import replace

from parallax.models.vit import ViTConfig

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)

DINOV2_L_REG4 = ViTConfig(
    width=1024,
    depth=24,
    num_heads=16,
    mlp_hidden=4096,
    class_token=True,
    reg_tokens=4,
    no_embed_class=True,
    layer_scale=1e-5,
    feature_layer=-2,
)
SIGLIP_SO400M = ViTConfig(
    width=1152,
    depth=27,
    num_heads=16,
    mlp_hidden=4304,
    class_token=False,
    feature_layer=-2,
    pool="map",
)
# timm id (without the pretrained tag) -> (architecture, normalisation mean, std)
TIMM_TOWERS = {
    "vit_large_patch14_reg4_dinov2": (DINOV2_L_REG4, IMAGENET_MEAN, IMAGENET_STD),
    "vit_so400m_patch14_siglip_224": (SIGLIP_SO400M, SIGLIP_MEAN, SIGLIP_STD),
}


def small_towers() -> tuple[tuple[ViTConfig, ViTConfig], tuple[ViTConfig, ViTConfig]]:
    """The (DINOv2, SigLIP) towers of the tiny and the small presets: the 7B's kinds of tower
    (registers and LayerScale; a MAP head), scaled down."""
    tiny = dict(image_size=56, depth=3, num_heads=4)  # what both towers of a preset share
    tiny_dino = replace(DINOV2_L_REG4, **tiny, width=32, mlp_hidden=128, layer_scale=0.1)
    tiny_siglip = replace(SIGLIP_SO400M, **tiny, width=48, mlp_hidden=184)
    small = dict(image_size=112, depth=6, num_heads=8)
    small_dino = replace(tiny_dino, **small, width=256, mlp_hidden=1024)
    small_siglip = replace(tiny_siglip, **small, width=288, mlp_hidden=1072)
    return (tiny_dino, tiny_siglip), (small_dino, small_siglip)

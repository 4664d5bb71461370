"""ViTConfig: the architecture of one vision tower (:mod:`parallax.models.vit` builds it).

Plain data with the checks and derived sizes every user of a tower needs (the planner, the
FLOP counts, the checkpoint readers) without building one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from parallax.models.config_file import check_divisible

ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")
# transformers' config.json names of a tower's sizes -> the ViTConfig fields (the dual encoders'
# TextConfig names them alike): one table for every reader and writer of such a tower
HF_SIZES = {
    "hidden_size": "width",
    "intermediate_size": "mlp_hidden",
    "num_hidden_layers": "depth",
    "num_attention_heads": "num_heads",
}
HF_IMAGE_SIZES = {**HF_SIZES, "image_size": "image_size", "patch_size": "patch_size"}
# transformers' CLIPVisionConfig() defaults, for the keys a CLIP vision_config leaves out
CLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of one vision tower.

    ``feature_layer`` picks the block whose output is the feature (negative counts from the
    end: -2 is the penultimate block, as OpenVLA and LLaVA use). ``no_embed_class``: the position
    embedding covers the patches only and the prefix tokens (class, registers) are prepended
    after it (timm's DINOv2); otherwise it covers prefix and patches. ``pool`` only describes
    the head that the checkpoint carries ("token", "map" for SigLIP's attention pool, "none");
    the feature extractor never runs it. ``patch_bias`` and ``causal`` serve the dual encoders
    (:mod:`parallax.families.siglip.model`): CLIP's bias-free patch conv and its causal text blocks.
    """

    image_size: int = 224
    patch_size: int = 14
    width: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_hidden: int = 4096
    class_token: bool = True
    reg_tokens: int = 0
    no_embed_class: bool = False
    layer_scale: float | None = None
    qkv_bias: bool = True
    ln_eps: float = 1e-6
    act: str = "gelu"
    pre_norm: bool = False
    final_norm: bool = False
    keep_prefix: bool = False
    feature_layer: int = -1
    pool: str = "token"
    patch_bias: bool = True  # CLIP's patch conv has none
    causal: bool = False  # causal self-attention (CLIP's text tower reuses these blocks)

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig: image_size {self.image_size} is not a multiple of "
                f"patch_size {self.patch_size}"
            )
        check_divisible(self, "width", "num_heads")
        if not -self.depth <= self.feature_layer < self.depth:
            raise ValueError(
                f"ViTConfig: feature_layer {self.feature_layer} is outside a "
                f"{self.depth}-block model"
            )
        if self.act not in ACTIVATIONS:
            raise ValueError(f"ViTConfig: act must be one of {ACTIVATIONS}, got {self.act!r}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.reg_tokens

    @property
    def feature_index(self) -> int:
        """0-based index of the last block that runs."""
        return self.feature_layer % self.depth

    @property
    def out_tokens(self) -> int:
        return self.num_patches + (self.num_prefix_tokens if self.keep_prefix else 0)

    def to_dict(self) -> dict:
        return asdict(self)

    def flops(self) -> float:
        """Forward FLOPs per image (matmuls and attention; 2 per multiply-add)."""
        n, w = self.num_patches + self.num_prefix_tokens, self.width
        block = 2 * n * (4 * w * w + 2 * w * self.mlp_hidden) + 4 * n * n * w
        patch = 2 * self.num_patches * 3 * self.patch_size**2 * w
        return patch + (self.feature_index + 1) * block


def sizes_from_hf(tower: Mapping[str, Any], keys: Mapping[str, str] = HF_IMAGE_SIZES) -> dict:
    """The sizes of a config.json tower dict as config fields (``keys``: theirs -> ours)."""
    return {ours: int(tower[theirs]) for theirs, ours in keys.items()}


def sizes_to_hf(config: Any, keys: Mapping[str, str] = HF_IMAGE_SIZES) -> dict:
    """A config's sizes under transformers' names, in the order of ``keys``."""
    return {theirs: getattr(config, ours) for theirs, ours in keys.items()}

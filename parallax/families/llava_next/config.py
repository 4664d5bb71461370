"""LlavaNextConfig: LLaVA-NeXT's architecture, and presets. It is read from and written to a
checkpoint's config.json (both formats, llava-hf and the original) by
:mod:`parallax.families.llava_next.hf_config`. Pinpoints are kept as (height, width), the
transformers convention.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from parallax.families.llava_next.hf_config import (
    ADDED_TOKENS,
    CLIP_L_336,
    KNOWN_TOWERS,
    VICUNA_PINPOINTS,
    VOCAB_MULTIPLE,
    config_from_hf,
    config_to_hf,
)
from parallax.models.config_file import ConfigFile
from parallax.models.llama import LlamaConfig
from parallax.models.llama_config import TINY_LLAMA
from parallax.models.llama_hf import LLAMA_DEFAULTS
from parallax.models.vit import ViTConfig

__all__ = [
    "ADDED_TOKENS",
    "CLIP_L_336",
    "CLIP_MEAN",
    "CLIP_STD",
    "KNOWN_TOWERS",
    "PRESETS",
    "VICUNA_PINPOINTS",
    "VOCAB_MULTIPLE",
    "LlavaNextConfig",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class LlavaNextConfig(ConfigFile):
    """Everything that shapes a LLaVA-NeXT model. ``vision`` is the CLIP tower (``feature_layer``
    is LLaVA's ``vision_feature_layer``), ``text`` the Llama, ``image_grid_pinpoints`` the AnyRes
    canvases as (height, width). ``checkpoint_vocab_size`` is the vocabulary of an original-layout
    checkpoint when it is smaller than ``text.vocab_size`` (the rows that get added)."""

    PRESET_KIND = "LLaVA-NeXT"

    vision: ViTConfig
    text: LlamaConfig
    image_grid_pinpoints: tuple[tuple[int, int], ...]
    image_token_index: int = 32000
    pad_token_id: int = 32001
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    max_length: int = 4096
    tokenizer: str = "llama2"
    checkpoint_vocab_size: int | None = None
    hf_config: dict = field(default_factory=dict, repr=False)
    source: str | None = None

    def __post_init__(self) -> None:
        self.image_grid_pinpoints = tuple(
            tuple(int(v) for v in p) for p in self.image_grid_pinpoints
        )
        s = self.tile_size
        bad = [p for p in self.image_grid_pinpoints if len(p) != 2 or p[0] % s or p[1] % s]
        if not self.image_grid_pinpoints or bad:
            raise ValueError(
                f"image_grid_pinpoints must be (height, width) pairs that are multiples of the "
                f"{s}px tile, got {list(self.image_grid_pinpoints)}"
            )
        for name, value in (
            ("image_token_index", self.image_token_index),
            ("pad_token_id", self.pad_token_id),
        ):
            if not 0 <= value < self.text.vocab_size:
                raise ValueError(
                    f"{name} {value} is outside the vocabulary of {self.text.vocab_size}"
                )
        if self.vision.keep_prefix or not self.vision.class_token:
            raise ValueError("the CLIP tower must have a class token that the features drop")

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def tile_size(self) -> int:
        return self.vision.image_size

    @property
    def tile_side(self) -> int:
        """Feature rows (and columns) per tile: 336 / 14 = 24."""
        return self.vision.image_size // self.vision.patch_size

    @property
    def tile_tokens(self) -> int:
        return self.tile_side**2

    @property
    def max_tiles(self) -> int:
        """Tiles of the largest canvas plus the base image (5 for LLaVA-v1.6)."""
        s = self.tile_size
        return 1 + max((h // s) * (w // s) for h, w in self.image_grid_pinpoints)

    @property
    def max_image_tokens(self) -> int:
        """The most image tokens one image can give (2,928 for LLaVA-v1.6: a 48 x 48 map)."""
        side, s = self.tile_side, self.tile_size
        grid = max((h // s * side) * (w // s * side + 1) for h, w in self.image_grid_pinpoints)
        return side * side + grid

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def with_options(self, **changes) -> LlavaNextConfig:
        """A copy with text options changed, e.g. ``fused_projections=True``."""
        return replace(self, text=replace(self.text, **changes))

    # -- config.json (presets and checkpoint directories: ConfigFile) ---------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> LlavaNextConfig:
        return config_from_hf(cls, d, source)

    def to_dict(self) -> dict:
        """config.json in the llava-hf format (what ``save_pretrained`` writes)."""
        if self.hf_config and self.checkpoint_vocab_size is None:
            return copy.deepcopy(self.hf_config)
        return config_to_hf(self)


def _presets() -> dict[str, LlavaNextConfig]:
    vicuna_7b = replace(
        LLAMA_DEFAULTS, vocab_size=32064, rms_norm_eps=1e-5, max_position_embeddings=4096
    )
    tiny_clip = replace(
        CLIP_L_336, image_size=28, patch_size=14, width=32, depth=3, num_heads=4, mlp_hidden=128
    )
    tiny_llama = replace(
        TINY_LLAMA,
        vocab_size=192,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    )
    return {
        "llava-v1.6-vicuna-7b": LlavaNextConfig(
            vision=CLIP_L_336, text=vicuna_7b, image_grid_pinpoints=VICUNA_PINPOINTS
        ),
        # tiles of 28 px (2 x 2 patches); the pinpoints are LLaVA-v1.6's divided by 12; the
        # character tokenizer's 128 ids, then <image> 128 and <pad> 129, in 192 rows
        "llava-tiny": LlavaNextConfig(
            vision=tiny_clip,
            text=tiny_llama,
            image_grid_pinpoints=((28, 56), (56, 28), (56, 56), (84, 28), (28, 84)),
            image_token_index=128,
            pad_token_id=129,
            max_length=512,
            tokenizer="tiny",
        ),
    }


PRESETS = _presets()
LlavaNextConfig.PRESETS = PRESETS

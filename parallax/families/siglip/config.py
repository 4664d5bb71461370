"""SiglipConfig: the architecture of a SigLIP or CLIP dual encoder, from config.json or a preset.

One config describes both families, since their towers are the same blocks and differ only in
options: SigLIP (``family="siglip"``) pools images with an attention head (MAP) and texts at the
last position, scores pairs with a sigmoid and has a ``logit_bias``; CLIP (``family="clip"``)
pools the class token and the end-of-text token, projects both towers, attends causally in the
text tower and scores with a softmax. A Hugging Face ``config.json`` lists only what differs
from the ``SiglipConfig()`` / ``CLIPConfig()`` defaults of transformers; those defaults fill the
rest here too.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, replace

from parallax.families.siglip.hf_config import config_from_hf, config_to_hf
from parallax.families.siglip.text_config import (
    CLIP_MEAN,
    CLIP_STD,
    FAMILIES,
    SIGLIP_MEAN,
    SIGLIP_STD,
    VISION_KIND,
    TextConfig,
    hf_act,
    parallax_act,
)
from parallax.models.config_file import ConfigFile
from parallax.models.vit import ViTConfig

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "PRESETS",
    "SIGLIP_MEAN",
    "SIGLIP_STD",
    "SiglipConfig",
    "TextConfig",
    "hf_act",
    "parallax_act",
]


@dataclass
class SiglipConfig(ConfigFile):
    """Both towers, the embedding width they meet in, and how pairs are scored.

    ``embed_dim``: SigLIP's MAP head gives the vision width and the text head maps to it; CLIP
    projects both towers to ``embed_dim`` without bias. ``logit_bias_init=None``: no bias (CLIP).
    ``resize``: "squash" (SigLIP: resize to the square, aspect ratio not kept) or "crop" (CLIP:
    shortest side to the image size, then a centre crop).
    """

    PRESET_KIND = "dual-encoder"

    vision: ViTConfig
    text: TextConfig
    family: str = "siglip"
    embed_dim: int | None = None
    logit_scale_init: float = math.log(10.0)
    logit_bias_init: float | None = -10.0
    image_mean: tuple[float, ...] = SIGLIP_MEAN
    image_std: tuple[float, ...] = SIGLIP_STD
    resize: str = "squash"
    tokenizer: str = "sentencepiece"
    hf_config: dict = field(default_factory=dict, repr=False)
    source: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.embed_dim is None:
            self.embed_dim = self.vision.width
        if self.family == "siglip" and self.embed_dim != self.vision.width:
            raise ValueError(
                f"SigLIP's MAP head gives vision width {self.vision.width}, so the text head "
                f"must map to it too, not to {self.embed_dim}"
            )
        if self.family == "siglip" and (self.vision.class_token or not self.vision.final_norm):
            raise ValueError("a SigLIP vision tower has no class token and a final LayerNorm")
        if self.family == "clip" and not (self.vision.class_token and self.vision.keep_prefix):
            raise ValueError("a CLIP vision tower pools its class token: class_token, keep_prefix")

    @property
    def loss(self) -> str:
        """The contrastive loss the family trains with: "sigmoid" or "softmax"."""
        return "sigmoid" if self.family == "siglip" else "softmax"

    @property
    def image_size(self) -> int:
        return self.vision.image_size

    # -- config.json (presets and checkpoint directories: ConfigFile) ---------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> SiglipConfig:
        return config_from_hf(cls, d, source)

    def to_dict(self) -> dict:
        """config.json: the checkpoint's own file when there was one, else the HF layout."""
        if self.hf_config:
            return copy.deepcopy(self.hf_config)
        return config_to_hf(self)

    def to_json_dict(self) -> dict:
        """Every field, for run metadata."""
        d = asdict(self)
        d.pop("hf_config")
        return d


def _vision(
    family: str, image: int, patch: int, w: int, depth: int, heads: int, mlp: int
) -> ViTConfig:
    """A preset's vision tower: its sizes, the family's activation and what sets its towers
    apart (:data:`VISION_KIND`)."""
    act, eps = ("gelu_tanh", 1e-6) if family == "siglip" else ("quick_gelu", 1e-5)
    sizes = dict(width=w, depth=depth, num_heads=heads, mlp_hidden=mlp)
    kind = VISION_KIND[family]
    return ViTConfig(image_size=image, patch_size=patch, **sizes, act=act, ln_eps=eps, **kind)


def _siglip(image: int, patch: int, w: int, depth: int, heads: int, mlp: int, **text) -> dict:
    vision = _vision("siglip", image, patch, w, depth, heads, mlp)
    t = dict(width=w, depth=depth, num_heads=heads, mlp_hidden=mlp)
    t.update(text)
    return dict(vision=vision, text=TextConfig(**t))


def _clip_text(**kw) -> TextConfig:
    base = dict(act="quick_gelu", ln_eps=1e-5, causal=True, pool="eos")
    return TextConfig(**{**base, **kw})


def _presets() -> dict[str, SiglipConfig]:
    clip = dict(
        family="clip",
        logit_scale_init=2.6592,  # log(1 / 0.07), as CLIP starts
        logit_bias_init=None,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        resize="crop",
    )
    tiny_text = dict(vocab_size=128, max_length=40, pad_id=1, eos_id=1)  # characters
    return {
        "siglip-large-patch16-256": SiglipConfig(**_siglip(256, 16, 1024, 24, 16, 4096)),
        "siglip-base-patch16-224": SiglipConfig(**_siglip(224, 16, 768, 12, 12, 3072)),
        # the bias starts at -ln 32, the prior of one positive among a CPU-sized batch of 32
        # captions: SigLIP's -10 suits batches of ~32k, and a tiny model trained from scratch
        # on small batches sits on its collapsed plateau (every pair alike) for hundreds of steps
        "siglip-tiny": SiglipConfig(
            **_siglip(32, 8, 64, 2, 4, 128, **tiny_text),
            tokenizer="tiny",
            logit_bias_init=-math.log(32),
        ),
        "clip-vit-large-patch14": SiglipConfig(
            vision=_vision("clip", 224, 14, 1024, 24, 16, 4096),
            text=_clip_text(
                vocab_size=49408,
                width=768,
                depth=12,
                num_heads=12,
                mlp_hidden=3072,
                max_length=77,
                pad_id=49407,
                eos_id=49407,
                bos_id=49406,
                pool="argmax",
            ),
            embed_dim=768,
            tokenizer="tokenizers",
            **clip,
        ),
        "clip-tiny": SiglipConfig(
            vision=_vision("clip", 32, 8, 64, 2, 4, 128),
            text=_clip_text(width=64, depth=2, num_heads=4, mlp_hidden=128, bos_id=2, **tiny_text),
            embed_dim=48,
            tokenizer="tiny",
            **clip,
        ),
    }


PRESETS = _presets()
SiglipConfig.PRESETS = PRESETS


def with_text(config: SiglipConfig, **changes) -> SiglipConfig:
    """A copy with text-tower options changed."""
    return replace(config, text=replace(config.text, **changes), hf_config={})

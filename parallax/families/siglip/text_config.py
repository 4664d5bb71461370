"""The text tower's shape, and the constants that a SigLIP or CLIP config and its Hugging Face
``config.json`` share (image statistics, activation names)."""

from __future__ import annotations

from dataclasses import dataclass

from parallax.models.config_file import check_divisible
from parallax.models.vit import ViTConfig

SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
FAMILIES = ("siglip", "clip")
POOLS = ("last", "eos", "argmax")
# what sets each family's vision towers apart, whatever their sizes: SigLIP's attention pool over
# the patches and final LayerNorm; CLIP's class token, pre-LayerNorm and bias-free patch conv
VISION_KIND = {
    "siglip": dict(class_token=False, final_norm=True, pool="map"),
    "clip": dict(class_token=True, pre_norm=True, keep_prefix=True, patch_bias=False),
}
# the text blocks' options, which ViTConfig names alike (the text blocks are ViT blocks)
BLOCK_OPTIONS = ("width", "depth", "num_heads", "mlp_hidden", "ln_eps", "act", "causal")
_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu", "gelu": "gelu"}
_HF_ACT = {v: k for k, v in _ACTS.items()}


@dataclass(frozen=True)
class TextConfig:
    """The text tower: token + position embeddings, pre-LN blocks, final LayerNorm, pooling.

    ``pool``: "last" takes the last position (SigLIP pads every caption to ``max_length``);
    "eos" the first ``eos_id``; "argmax" the largest id (CLIP checkpoints whose config says
    ``eos_token_id=2``, where transformers does the same, since the end-of-text id is the
    largest). ``bos_id`` is prepended by the tokenizer when set (CLIP).
    """

    vocab_size: int = 32000
    width: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_hidden: int = 3072
    max_length: int = 64
    act: str = "gelu_tanh"
    ln_eps: float = 1e-6
    causal: bool = False
    pool: str = "last"
    pad_id: int = 1
    eos_id: int = 1
    bos_id: int | None = None

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"TextConfig: pool must be one of {POOLS}, got {self.pool!r}")
        check_divisible(self, "width", "num_heads")

    def block_config(self) -> ViTConfig:
        """The options of these text blocks (:class:`~parallax.models.vit.ViTBlock` s)."""
        return ViTConfig(**{name: getattr(self, name) for name in BLOCK_OPTIONS})

    def flops(self, length: int | None = None) -> float:
        """Forward FLOPs of the blocks per caption (2 per multiply-add; causal attention half)."""
        n, w = length or self.max_length, self.width
        attn = (2 if self.causal else 4) * n * n * w
        return self.depth * (2 * n * (4 * w * w + 2 * w * self.mlp_hidden) + attn)


def hf_act(act: str) -> str:
    return _HF_ACT[act]


def parallax_act(hf: str) -> str:
    if hf not in _ACTS:
        raise ValueError(f"hidden_act {hf!r} is not supported (one of {sorted(_ACTS)})")
    return _ACTS[hf]

"""What any model uses: the ViT and Llama blocks, the vision-language base, pipeline blocks,
compilation and checkpointing of blocks, and Hugging Face checkpoint I/O.

The families (OpenVLA, LLaVA-NeXT, SigLIP/CLIP) live in :mod:`parallax.families`. Their names
were once importable from here; they still are, for one release, through :func:`__getattr__`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from parallax.models.llama import KVCache, LlamaConfig, LlamaLM
from parallax.models.stages import StageBlock, partition
from parallax.models.tokenizer import HFTokenizer
from parallax.models.vit import VisionTransformer, ViTConfig

__all__ = [
    "HFTokenizer",
    "KVCache",
    "LlamaConfig",
    "LlamaLM",
    "StageBlock",
    "ViTConfig",
    "VisionTransformer",
    "partition",
]

# Deprecated aliases, kept for one release (0.2): the names that moved into a family package.
MOVED = {
    "ActionTokenizer": "parallax.families.openvla",
    "normalize_actions": "parallax.families.openvla",
    "unnormalize_actions": "parallax.families.openvla",
    "OpenVLA": "parallax.families.openvla",
    "OpenVLAConfig": "parallax.families.openvla",
    "openvla_init_fn": "parallax.families.openvla",
    "action_metrics": "parallax.families.openvla",
    "expand_labels": "parallax.families.openvla",
    "loss_token_count": "parallax.families.openvla",
    "vla_loss": "parallax.families.openvla",
    "generate": "parallax.families.openvla",
    "predict_action": "parallax.families.openvla",
    "pixel_values": "parallax.families.openvla",
    "preprocess_image": "parallax.families.openvla",
    "TinyTokenizer": "parallax.families.openvla",
    "build_prompt": "parallax.families.openvla",
    "get_tokenizer": "parallax.families.openvla",
    "prompt_ids": "parallax.families.openvla",
    "training_example": "parallax.families.openvla",
    "LlavaNext": "parallax.families.llava_next",
    "LlavaNextConfig": "parallax.families.llava_next",
    "LlavaNextProcessor": "parallax.families.llava_next",
    "LlavaTinyTokenizer": "parallax.families.llava_next",
    "llava_init_fn": "parallax.families.llava_next",
    "anyres": "parallax.families.llava_next",
    "Siglip": "parallax.families.siglip",
    "SiglipConfig": "parallax.families.siglip",
    "SiglipOutput": "parallax.families.siglip",
    "TextConfig": "parallax.families.siglip",
    "siglip_init_fn": "parallax.families.siglip",
    "tp_argmax": "parallax.tensor.loss",
}


def __getattr__(name: str) -> Any:
    """A name that moved into a family, imported from there (lazily: a family is imported only
    when one of its names is asked for) with a ``FutureWarning``."""
    if name not in MOVED:
        raise AttributeError(f"module 'parallax.models' has no attribute {name!r}")
    warnings.warn(
        f"parallax.models.{name} moved to {MOVED[name]}.{name}; the old name goes in 0.2",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(MOVED[name]), name)

"""Models built from parallax tensor layers: a generic ViT, Llama blocks, OpenVLA, LLaVA-NeXT and
the SigLIP / CLIP dual encoders."""

from parallax.models.action_tokenizer import (
    ActionTokenizer,
    normalize_actions,
    unnormalize_actions,
)
from parallax.models.config import OpenVLAConfig
from parallax.models.llama import KVCache, LlamaConfig, LlamaLM
from parallax.models.llava_config import LlavaNextConfig
from parallax.models.llava_next import LlavaNext
from parallax.models.llava_processor import LlavaNextProcessor
from parallax.models.llava_template import LlavaTinyTokenizer
from parallax.models.llava_vision import llava_init_fn
from parallax.models.objectives import (
    action_metrics,
    expand_labels,
    loss_token_count,
    tp_argmax,
    vla_loss,
)
from parallax.models.openvla import OpenVLA, openvla_init_fn
from parallax.models.predict import generate, predict_action
from parallax.models.preprocess import pixel_values, preprocess_image
from parallax.models.siglip import Siglip, SiglipOutput, siglip_init_fn
from parallax.models.siglip_config import SiglipConfig, TextConfig
from parallax.models.stages import StageBlock, partition
from parallax.models.tokenizer import (
    HFTokenizer,
    TinyTokenizer,
    build_prompt,
    get_tokenizer,
    prompt_ids,
    training_example,
)
from parallax.models.vit import VisionTransformer, ViTConfig

__all__ = [
    "ActionTokenizer",
    "HFTokenizer",
    "KVCache",
    "LlamaConfig",
    "LlamaLM",
    "LlavaNext",
    "LlavaNextConfig",
    "LlavaNextProcessor",
    "LlavaTinyTokenizer",
    "OpenVLA",
    "OpenVLAConfig",
    "Siglip",
    "SiglipConfig",
    "SiglipOutput",
    "StageBlock",
    "TextConfig",
    "TinyTokenizer",
    "ViTConfig",
    "VisionTransformer",
    "action_metrics",
    "build_prompt",
    "expand_labels",
    "generate",
    "get_tokenizer",
    "llava_init_fn",
    "loss_token_count",
    "normalize_actions",
    "openvla_init_fn",
    "partition",
    "pixel_values",
    "predict_action",
    "preprocess_image",
    "prompt_ids",
    "siglip_init_fn",
    "training_example",
    "tp_argmax",
    "unnormalize_actions",
    "vla_loss",
]

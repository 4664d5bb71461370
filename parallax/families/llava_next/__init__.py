"""LLaVA-NeXT (LLaVA-v1.6): a CLIP ViT-L/14-336, an mlp2x_gelu projector, AnyRes tiling and a
Vicuna (Llama-2) language model (see ``docs/families.md`` and ``shared/models.md``).

Files: ``config`` (presets, the three published config.json forms), ``model``, ``vision`` (the
projector and the image features), ``anyres``, ``checkpoint`` and ``vocab`` (the published
layouts), ``template`` and ``processor`` (prompts, tokenizers, images), ``objectives``,
``predict``, ``flops``, and the trainer's side: ``recipe`` and ``batches``.
"""

from parallax.families.llava_next import anyres
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.model import LlavaNext
from parallax.families.llava_next.predict import answer, generate
from parallax.families.llava_next.processor import LlavaNextProcessor
from parallax.families.llava_next.recipe import LlavaRecipe
from parallax.families.llava_next.template import LlavaTinyTokenizer
from parallax.families.llava_next.vision import llava_init_fn

__all__ = [
    "LlavaNext",
    "LlavaNextConfig",
    "LlavaNextProcessor",
    "LlavaRecipe",
    "LlavaTinyTokenizer",
    "answer",
    "anyres",
    "generate",
    "llava_init_fn",
]

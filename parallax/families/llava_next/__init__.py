"""LLaVA-NeXT (LLaVA-v1.6): a CLIP ViT-L/14-336, an mlp2x_gelu projector, AnyRes tiling and a
Vicuna (Llama-2) language model (see ``docs/families.md`` and ``shared/models.md``).

Files: ``config`` (presets, the three published config.json forms), ``model``, ``vision`` (the
projector and the image features), ``anyres``, ``checkpoint`` and ``vocab`` (the published
layouts), ``template`` and ``processor`` (prompts, tokenizers, images), ``objective``,
``predict``, ``flops`` and ``estimate`` (the blocks as the planner sees them), and the trainer's
side: ``recipe`` (the sides and the objective composed), ``sides``, ``batches`` (samples ->
microbatches) and ``data`` (what ``--data`` opens, the length-grouped loader's lengths).
"""

from parallax.families import lazy_exports

EXPORTS = {  # module -> the public names it defines
    "config": ("LlavaNextConfig",),
    "model": ("LlavaNext",),
    "predict": ("answer", "generate"),
    "processor": ("LlavaNextProcessor",),
    "recipe": ("LlavaRecipe",),
    "template": ("LlavaTinyTokenizer",),
    "vision": ("llava_init_fn",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)

"""SigLIP and CLIP image-text dual encoders (Git-RSCLIP's SigLIP-large is the reference;
CLIP is a preset of the same family; see ``docs/families.md`` and ``shared/models.md``).

Files: ``config`` and ``hf_config`` (presets, config.json), ``model`` and ``towers``,
``checkpoint`` (the HF ``SiglipModel`` / ``CLIPModel`` layouts), ``inputs`` (tokenizers, image
preprocessing), ``objective`` and ``step`` (the loss over the dp group, a step's forwards and
backwards), ``predict`` and ``evaluate`` (zero-shot and recall@k), ``flops`` and ``estimate``
(the blocks as the planner sees them), and the trainer's side: ``recipe`` (the sides and the
objective composed), ``sides``, ``batches`` (pairs -> microbatches) and ``data`` (what
``--data`` opens).
"""

from parallax.families import lazy_exports

EXPORTS = {  # module -> the public names it defines
    "config": ("SiglipConfig", "TextConfig"),
    "model": ("Siglip", "SiglipOutput", "siglip_init_fn"),
    "recipe": ("SiglipRecipe",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)

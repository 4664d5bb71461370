"""SigLIP and CLIP image-text dual encoders (Git-RSCLIP's SigLIP-large is the reference;
CLIP is a preset of the same family; see ``docs/families.md`` and ``shared/models.md``).

Files: ``config`` and ``hf_config`` (presets, config.json), ``model`` and ``towers``,
``checkpoint`` (the HF ``SiglipModel`` / ``CLIPModel`` layouts), ``inputs`` (tokenizers, image
preprocessing), ``step`` (a step's forwards and backwards with the loss over the dp group),
``retrieval`` and ``evaluate`` (zero-shot and recall@k), and the trainer's side: ``recipe`` and
``data``.
"""

from parallax.families.siglip.config import SiglipConfig, TextConfig
from parallax.families.siglip.model import Siglip, SiglipOutput, siglip_init_fn
from parallax.families.siglip.recipe import SiglipRecipe

__all__ = ["Siglip", "SiglipConfig", "SiglipOutput", "SiglipRecipe", "TextConfig", "siglip_init_fn"]

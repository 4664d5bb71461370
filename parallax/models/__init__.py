"""What any model uses: the ViT and Llama blocks, the vision-language base, pipeline blocks,
compilation and checkpointing of blocks, and Hugging Face checkpoint I/O.

The families (OpenVLA, LLaVA-NeXT, SigLIP/CLIP) live in :mod:`parallax.families`; their names
are imported from there (the aliases that kept them importable from here are gone).
"""

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

"""OpenVLA: DINOv2 + SigLIP towers, a fused GELU projector and Llama-2, trained on discrete
action tokens (see ``docs/families.md`` and ``shared/openvla.md``).

Files: ``config`` (presets, config.json), ``model``, ``checkpoint`` (the HF layout), ``prompt``
and ``action_tokenizer`` (the text and action ids), ``preprocess`` (images), ``objectives``
(loss and action metrics), ``predict`` (decoding), ``flops`` and ``lora_flops``, and the
trainer's side: ``recipe``, ``batches`` (samples -> microbatches) and ``data`` (robot datasets).

OpenVLA-OFT (``--action-head l1``, ``shared/oft.md``): ``oft_config`` (its options and the
positions the head reads), ``oft_head`` (the L1 head, the proprio projector, OFT's key names),
``oft_model`` (the first stage's sequence), ``oft_batches``, ``oft_objective`` (loss, metrics,
FLOPs), ``oft_data`` (what the data gives), ``oft_predict`` (``predict_action_chunk``),
``oft_export`` and ``oft_policy`` (a policy from a checkpoint or an export).
"""

from parallax.families.openvla.action_tokenizer import (
    ActionTokenizer,
    normalize_actions,
    unnormalize_actions,
)
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA, openvla_init_fn
from parallax.families.openvla.objectives import (
    action_metrics,
    expand_labels,
    loss_token_count,
    vla_loss,
)
from parallax.families.openvla.oft_config import OFTConfig
from parallax.families.openvla.oft_policy import load_policy
from parallax.families.openvla.oft_predict import predict_action_chunk
from parallax.families.openvla.predict import generate, predict_action
from parallax.families.openvla.preprocess import pixel_values, preprocess_image
from parallax.families.openvla.prompt import (
    TinyTokenizer,
    build_prompt,
    get_tokenizer,
    prompt_ids,
    training_example,
)
from parallax.families.openvla.recipe import OpenVLARecipe

__all__ = [
    "ActionTokenizer",
    "OFTConfig",
    "OpenVLA",
    "OpenVLAConfig",
    "OpenVLARecipe",
    "TinyTokenizer",
    "action_metrics",
    "build_prompt",
    "expand_labels",
    "generate",
    "get_tokenizer",
    "load_policy",
    "loss_token_count",
    "normalize_actions",
    "openvla_init_fn",
    "pixel_values",
    "predict_action",
    "predict_action_chunk",
    "preprocess_image",
    "prompt_ids",
    "training_example",
    "unnormalize_actions",
    "vla_loss",
]

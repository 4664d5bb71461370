"""OpenVLA: DINOv2 + SigLIP towers, a fused GELU projector and Llama-2, trained on discrete
action tokens (see ``docs/families.md`` and ``shared/openvla.md``).

Files: ``config`` (presets, config.json), ``model``, ``checkpoint`` (the HF layout), ``prompt``
and ``action_tokenizer`` (the text and action ids), ``preprocess`` (images), ``objective``
(loss and action metrics), ``predict`` (decoding), ``flops`` and ``lora_flops``, ``estimate``
(the blocks as the planner sees them), and the trainer's side: ``recipe`` (the model side, the
data side and the objective composed), ``sides``, ``batches`` (samples -> microbatches) and
``data`` (robot datasets).

OpenVLA-OFT (``--action-head l1``, ``shared/oft.md``) is the subpackage ``oft``: ``options``
(the family's own flags), ``config`` (OFT's model options and the positions the head reads),
``head`` (the L1 head, the proprio projector, OFT's key names), ``model`` (the first stage's
sequence), ``batches``, ``objective`` (loss, metrics, FLOPs), ``data`` (what the data gives),
``sides`` (the recipe's model and data sides), ``predict`` (``predict_action_chunk``),
``export`` and ``policy`` (a policy from a checkpoint or an export).
"""

from parallax.families import lazy_exports

EXPORTS = {
    "ActionTokenizer": "action_tokenizer",
    "OFTConfig": "oft.config",
    "OpenVLA": "model",
    "OpenVLAConfig": "config",
    "OpenVLARecipe": "recipe",
    "TinyTokenizer": "prompt",
    "action_metrics": "objective",
    "build_prompt": "prompt",
    "expand_labels": "objective",
    "generate": "predict",
    "get_tokenizer": "prompt",
    "load_policy": "oft.policy",
    "loss_token_count": "objective",
    "normalize_actions": "action_tokenizer",
    "openvla_init_fn": "model",
    "pixel_values": "preprocess",
    "predict_action": "predict",
    "predict_action_chunk": "oft.predict",
    "preprocess_image": "preprocess",
    "prompt_ids": "prompt",
    "training_example": "prompt",
    "unnormalize_actions": "action_tokenizer",
    "vla_loss": "objective",
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)

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
``export``, ``released`` (OFT's own released folders) and ``policy`` (a policy from a
checkpoint, an export or OFT's release).
"""

from parallax.families import lazy_exports

EXPORTS = {  # module -> the public names it defines
    "action_tokenizer": ("ActionTokenizer", "normalize_actions", "unnormalize_actions"),
    "config": ("OpenVLAConfig",),
    "model": ("OpenVLA", "openvla_init_fn"),
    "objective": ("action_metrics", "expand_labels", "loss_token_count", "vla_loss"),
    "oft.config": ("OFTConfig",),
    "oft.objective": ("OFTLoss", "oft_loss"),
    "oft.policy": ("load_policy",),
    "oft.predict": ("predict_action_chunk",),
    "predict": ("generate", "predict_action"),
    "preprocess": ("pixel_values", "preprocess_image"),
    "prompt": ("TinyTokenizer", "build_prompt", "get_tokenizer", "prompt_ids", "training_example"),
    "recipe": ("OpenVLARecipe",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)

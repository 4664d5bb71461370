"""A Llama's shape from a Hugging Face ``text_config``: what OpenVLA and LLaVA checkpoints carry.

A ``text_config`` lists only what differs from transformers' ``LlamaConfig()`` defaults; the
architecture is rebuilt from exactly that, and options parallax's Llama does not implement fail.
"""

from __future__ import annotations

from dataclasses import replace

from parallax.models.llama import LlamaConfig

LLAMA_DEFAULTS = LlamaConfig()  # what transformers' LlamaConfig() gives for missing keys
TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)


def text_config_from_hf(tc: dict) -> LlamaConfig:
    """LlamaConfig defaults overridden by the file's text_config; unsupported options fail."""
    unsupported = {
        "hidden_act": ("silu",),
        "attention_bias": (False,),
        "rope_scaling": (None,),
        "tie_word_embeddings": (False,),
        "mlp_bias": (False,),
    }
    for key, allowed in unsupported.items():
        if key in tc and tc[key] not in allowed:
            raise ValueError(f"text_config.{key}={tc[key]!r} is not supported (only {allowed})")
    values = {k: tc[k] for k in TEXT_KEYS if tc.get(k) is not None}
    rope = tc.get("rope_parameters") or {}  # where transformers 5.x writes rope_theta
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"text_config.rope_parameters.rope_type={rope['rope_type']!r} is not supported "
            "(only 'default')"
        )
    if "rope_theta" not in values and rope.get("rope_theta") is not None:
        values["rope_theta"] = rope["rope_theta"]
    config = replace(LLAMA_DEFAULTS, **values)
    head_dim = tc.get("head_dim")
    if head_dim is not None and head_dim != config.hidden_size // config.num_attention_heads:
        raise ValueError(
            f"text_config.head_dim={head_dim} is not supported (only hidden_size / "
            f"num_attention_heads = {config.hidden_size // config.num_attention_heads})"
        )
    return config

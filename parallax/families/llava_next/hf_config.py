"""config.json <-> :class:`~parallax.families.llava_next.config.LlavaNextConfig`, both formats.

Two config.json formats exist. The llava-hf one (``model_type "llava_next"``, also what transformers
5.x writes) nests a CLIP ``vision_config`` and a Llama ``text_config`` that list only what differs
from the transformers defaults. The original ``liuhaotian/llava-v1.6-*`` one is a Llama config with
``mm_*`` keys; it names the CLIP tower by hub id and its vocabulary (32000) lacks ``<image>`` and
``<pad>``: parallax maps it onto the llava-hf vocabulary as the Hugging Face converter does
(``<image>`` = 32000, ``<pad>`` = 32001, rows up to a multiple of 64, i.e. 32064; see
:mod:`parallax.families.llava_next.vocab`). Pinpoints are kept as (height, width), the transformers
convention; the original file lists them as (width, height) and they are swapped on reading.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, TypeVar

from parallax.models.llama_hf import text_config_from_hf
from parallax.models.vit import ViTConfig
from parallax.models.vit_config import CLIP_VISION_DEFAULTS, sizes_from_hf, sizes_to_hf

# the config class these build (LlavaNextConfig, which imports this module: taken as a parameter)
Config = TypeVar("Config")

VICUNA_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
CLIP_L_336 = ViTConfig(
    image_size=336,
    patch_size=14,
    width=1024,
    depth=24,
    num_heads=16,
    mlp_hidden=4096,
    class_token=True,
    ln_eps=1e-5,
    act="quick_gelu",
    pre_norm=True,
    feature_layer=-2,
    pool="none",
    patch_bias=False,
)
KNOWN_TOWERS = {"openai/clip-vit-large-patch14-336": CLIP_L_336}
ADDED_TOKENS = 2  # <image>, <pad>
VOCAB_MULTIPLE = 64


def config_from_hf(cls: type[Config], d: dict, source: str | None) -> Config:
    """``cls`` from either config.json format, or a ``ValueError`` naming what is unsupported."""
    if d.get("model_type") == "llava_next" or ("vision_config" in d and "text_config" in d):
        return _from_llava_hf(cls, d, source)
    if "mm_vision_tower" in d or d.get("model_type") in ("llava", "llava_llama"):
        return _from_original(cls, d, source)
    raise ValueError(
        f"config.json of {source or 'the checkpoint'} is neither a llava-hf LLaVA-NeXT config "
        f"(model_type 'llava_next') nor an original LLaVA one (mm_vision_tower); it has "
        f"model_type {d.get('model_type')!r}"
    )


def config_to_hf(config: Any) -> dict:
    """config.json in the llava-hf format, built from the fields."""
    v, t = config.vision, config.text
    d = {
        "architectures": ["LlavaNextForConditionalGeneration"],
        "model_type": "llava_next",
        "ignore_index": -100,
        "image_token_index": config.image_token_index,
        "image_grid_pinpoints": [list(p) for p in config.image_grid_pinpoints],
        "projector_hidden_act": "gelu",
        "use_image_newline_parameter": True,
        "vision_feature_layer": v.feature_layer,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False,
        "pad_token_id": config.pad_token_id,
        "vocab_size": t.vocab_size,
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "rms_norm_eps": t.rms_norm_eps,
            "rope_theta": t.rope_theta,
            "max_position_embeddings": t.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            **sizes_to_hf(v),
            "hidden_act": v.act,
            "layer_norm_eps": v.ln_eps,
        },
        "parallax_max_length": config.max_length,
    }
    if config.tokenizer != "llama2":
        d["parallax_tokenizer"] = config.tokenizer
    return d


def _vision_from_clip(vc: dict, feature_layer: int) -> ViTConfig:
    c = {**CLIP_VISION_DEFAULTS, **{k: v for k, v in vc.items() if v is not None}}
    if c["hidden_act"] not in ("quick_gelu", "gelu"):
        raise ValueError(f"vision_config.hidden_act={c['hidden_act']!r} is not supported")
    return replace(
        CLIP_L_336,
        **sizes_from_hf(c),
        ln_eps=float(c["layer_norm_eps"]),
        act=c["hidden_act"],
        feature_layer=int(feature_layer),
    )


def _require(d: dict, key: str, allowed: tuple, default) -> None:
    value = d.get(key, default)
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not supported (only {allowed})")


def _from_llava_hf(cls: type[Config], d: dict, source: str | None) -> Config:
    _require(d, "vision_feature_select_strategy", ("default",), "default")
    _require(d, "projector_hidden_act", ("gelu",), "gelu")
    _require(d, "use_image_newline_parameter", (True,), True)
    _require(d, "multimodal_projector_bias", (True,), True)
    layer = d.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r}: only one feature layer is supported")
    vc = d.get("vision_config") or {}
    if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"vision_config.model_type={vc['model_type']!r}: only CLIP is supported")
    text = text_config_from_hf(d.get("text_config") or {})
    image_token = int(d.get("image_token_index", 32000))
    return cls(
        vision=_vision_from_clip(vc, layer),
        text=text,
        image_grid_pinpoints=d.get("image_grid_pinpoints", VICUNA_PINPOINTS),
        image_token_index=image_token,
        pad_token_id=_pad_token_id(d, image_token, text.vocab_size),
        max_length=int(d.get("parallax_max_length", 4096)),
        tokenizer=d.get("parallax_tokenizer", "llama2"),
        hf_config=copy.deepcopy(d),
        source=source,
    )


def _pad_token_id(d: dict, image_token: int, vocab: int) -> int:
    """The id the processor pads with: the file's (top level, or the text config's, where
    transformers 5.x keeps it), else derived. transformers' LLaVA-NeXT model reads no pad id
    (the attention mask and the labels hide the padding), so a file without one is valid: the
    Hugging Face converter's ``<pad>`` right after ``<image>`` where the vocabulary has it
    (32001 of 32064), else the vocabulary's last id that is not ``<image>``."""
    for value in (d.get("pad_token_id"), (d.get("text_config") or {}).get("pad_token_id")):
        if value is not None:
            return int(value)
    if image_token + 1 < vocab:
        return image_token + 1
    return vocab - 1 if vocab - 1 != image_token else vocab - 2


def _from_original(cls: type[Config], d: dict, source: str | None) -> Config:
    _require(d, "mm_projector_type", ("mlp2x_gelu",), None)
    _require(d, "mm_patch_merge_type", ("spatial_unpad",), None)
    _require(d, "image_aspect_ratio", ("anyres",), None)
    _require(d, "mm_vision_select_feature", ("patch",), "patch")
    tower = d["mm_vision_tower"]
    layer = int(d.get("mm_vision_select_layer", -2))
    if d.get("parallax_vision_config"):
        vision = _vision_from_clip(d["parallax_vision_config"], layer)
    elif tower in KNOWN_TOWERS:
        vision = replace(KNOWN_TOWERS[tower], feature_layer=layer)
    else:
        raise ValueError(
            f"unknown mm_vision_tower {tower!r}: known towers are {sorted(KNOWN_TOWERS)} (or "
            "describe it in 'parallax_vision_config' as a CLIP vision_config)"
        )
    text = text_config_from_hf(d)
    old = text.vocab_size
    new = -(-(old + ADDED_TOKENS) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    pinpoints = [(h, w) for w, h in d.get("image_grid_pinpoints", VICUNA_PINPOINTS)]
    return cls(
        vision=vision,
        text=replace(text, vocab_size=new),
        image_grid_pinpoints=pinpoints,
        image_token_index=old,
        pad_token_id=old + 1,
        max_length=int(d.get("tokenizer_model_max_length") or 4096),
        tokenizer=d.get("parallax_tokenizer", "llama2"),
        checkpoint_vocab_size=old,
        hf_config=copy.deepcopy(d),
        source=source,
    )

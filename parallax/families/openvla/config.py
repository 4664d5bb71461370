"""OpenVLAConfig: the architecture read from a checkpoint's config.json, and presets.

A Hugging Face OpenVLA ``config.json`` names its two vision towers by timm id and carries a
``text_config`` that lists only what differs from ``LlamaConfig()`` defaults; the architecture is
rebuilt from exactly that, so a checkpoint with a smaller language model loads too. Towers that
timm does not know (the ``tiny`` preset) are described in an extra ``vision_configs`` key.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from parallax.families.openvla.oft.config import OFTConfig
from parallax.families.openvla.towers import (
    DINOV2_L_REG4,
    IMAGENET_MEAN,
    IMAGENET_STD,
    SIGLIP_MEAN,
    SIGLIP_SO400M,
    SIGLIP_STD,
    TIMM_TOWERS,
    small_towers,
)
from parallax.models.config_file import ConfigFile
from parallax.models.llama import LlamaConfig
from parallax.models.llama_config import TINY_LLAMA
from parallax.models.llama_hf import LLAMA_DEFAULTS, TEXT_KEYS, text_config_from_hf
from parallax.models.vit import ViTConfig

__all__ = [
    "DINOV2_L_REG4",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PRESETS",
    "SIGLIP_MEAN",
    "SIGLIP_SO400M",
    "SIGLIP_STD",
    "TIMM_TOWERS",
    "OpenVLAConfig",
]

_AUTO_MAP = {
    "AutoConfig": "configuration_prismatic.OpenVLAConfig",
    "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction",
}


@dataclass
class OpenVLAConfig(ConfigFile):
    """Everything that shapes an OpenVLA model, plus the dataset statistics it un-normalises
    actions with. ``vision`` is (DINOv2 featurizer, SigLIP fused featurizer); ``text`` the Llama.
    """

    PRESET_KIND = "OpenVLA"

    vision: tuple[ViTConfig, ViTConfig]
    text: LlamaConfig
    timm_model_ids: tuple[str, str]
    image_mean: tuple[tuple[float, ...], tuple[float, ...]] = (IMAGENET_MEAN, SIGLIP_MEAN)
    image_std: tuple[tuple[float, ...], tuple[float, ...]] = (IMAGENET_STD, SIGLIP_STD)
    pad_token_id: int = 32000
    pad_to_multiple_of: int = 64
    n_action_bins: int = 256
    llm_max_length: int = 2048
    tokenizer: str = "llama2"
    norm_stats: dict = field(default_factory=dict)
    hf_config: dict = field(default_factory=dict, repr=False)
    source: str | None = None
    oft: OFTConfig | None = None  # OpenVLA-OFT's head, cameras and proprio (oft/config.py)
    text_multiple: int = 1  # the collated text's width rounds up to this (--pad-to-multiple-of)

    def __post_init__(self) -> None:
        a, b = self.vision
        if a.image_size != b.image_size or a.out_tokens != b.out_tokens:
            raise ValueError(
                f"the two vision towers must see the same image size and give the same number "
                f"of tokens: {a.image_size}px/{a.out_tokens} vs {b.image_size}px/{b.out_tokens}"
            )
        if self.tokenizer_vocab_size < self.n_action_bins + 1:
            raise ValueError(
                f"text vocabulary {self.tokenizer_vocab_size} cannot hold {self.n_action_bins} "
                "action tokens"
            )

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def image_size(self) -> int:
        return self.vision[0].image_size

    @property
    def num_patches(self) -> int:
        return self.vision[0].out_tokens

    @property
    def vision_dim(self) -> int:
        return self.vision[0].width + self.vision[1].width

    @property
    def tokenizer_vocab_size(self) -> int:
        """The text tokenizer's vocabulary (32000): action ids are ``this - bin``."""
        return self.text.vocab_size - self.pad_to_multiple_of

    def action_stats(self, unnorm_key: str | None) -> dict | None:
        """``norm_stats[unnorm_key]["action"]``; ``None`` when there are no statistics."""
        if not self.norm_stats:
            if unnorm_key is not None:
                raise ValueError(f"unnorm_key {unnorm_key!r} given but the model has no norm_stats")
            return None
        if unnorm_key is None:
            if len(self.norm_stats) != 1:
                raise ValueError(
                    "the model has statistics for several datasets; pass unnorm_key, one of "
                    f"{sorted(self.norm_stats)}"
                )
            unnorm_key = next(iter(self.norm_stats))
        if unnorm_key not in self.norm_stats:
            raise ValueError(
                f"unnorm_key {unnorm_key!r} not in norm_stats; choose one of "
                f"{sorted(self.norm_stats)}"
            )
        return self.norm_stats[unnorm_key]["action"]

    @property
    def prefix_tokens(self) -> int:
        """Tokens inserted after BOS: the patches (of every image, with OFT) and OFT's proprio
        token."""
        return self.num_patches if self.oft is None else self.oft.prefix(self.num_patches)

    def with_options(self, **changes) -> OpenVLAConfig:
        """A copy with text options changed, e.g. ``fused_projections=True``."""
        return replace(self, text=replace(self.text, **changes))

    # -- config.json (presets and checkpoint directories: ConfigFile) ---------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> OpenVLAConfig:
        if not d.get("use_fused_vision_backbone", True):
            raise ValueError("only the fused DINOv2 + SigLIP vision backbone is supported")
        arch = d.get("arch_specifier", "no-align+fused-gelu-mlp")
        if not arch.endswith("fused-gelu-mlp"):
            raise ValueError(f"arch_specifier {arch!r} unsupported: expected '*fused-gelu-mlp'")
        if any(d.get("timm_override_act_layers") or []):
            raise ValueError("timm_override_act_layers other than null are not supported")
        ids = tuple(d.get("timm_model_ids", ()))
        if len(ids) != 2:
            raise ValueError(f"expected two timm_model_ids (DINOv2, SigLIP), got {list(ids)}")
        if d.get("vision_configs"):
            towers, means, stds = [], [], []
            for v in d["vision_configs"]:
                v = dict(v)
                means.append(tuple(v.pop("mean")))
                stds.append(tuple(v.pop("std")))
                towers.append(ViTConfig(**v))
        else:
            known = [TIMM_TOWERS.get(i.split(".")[0]) for i in ids]
            if None in known:
                raise ValueError(
                    f"unknown timm_model_ids {list(ids)}: known towers are {sorted(TIMM_TOWERS)} "
                    "(or describe the towers in 'vision_configs')"
                )
            towers, means, stds = (list(x) for x in zip(*known))
        sizes = d.get("image_sizes") or [t.image_size for t in towers]
        towers = [replace(t, image_size=int(s)) for t, s in zip(towers, sizes)]
        text = text_config_from_hf(d.get("text_config", {}))
        return cls(
            vision=tuple(towers),
            text=text,
            timm_model_ids=ids,
            image_mean=tuple(means),
            image_std=tuple(stds),
            pad_token_id=int(d.get("pad_token_id", 32000)),
            pad_to_multiple_of=int(d.get("pad_to_multiple_of", 64)),
            n_action_bins=int(d.get("n_action_bins", 256)),
            llm_max_length=int(d.get("llm_max_length", 2048)),
            tokenizer=d.get("parallax_tokenizer", "llama2"),
            norm_stats=copy.deepcopy(d.get("norm_stats") or {}),
            hf_config=copy.deepcopy(d),
            source=source,
            oft=OFTConfig.from_dict(d["parallax_oft"]) if d.get("parallax_oft") else None,
        )

    def to_dict(self) -> dict:
        """The config.json contents: the original file when there was one, with norm_stats."""
        if self.hf_config:
            d = copy.deepcopy(self.hf_config)
            d["norm_stats"] = copy.deepcopy(self.norm_stats)
            d.pop("parallax_oft", None)
            return {**d, **self._oft_dict()}
        t = self.text
        text_config = {k: getattr(t, k) for k in TEXT_KEYS}
        text_config.update(
            model_type="llama",
            pad_token_id=self.pad_token_id,
            hidden_act="silu",
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        )
        d = {
            "architectures": ["OpenVLAForActionPrediction"],
            "auto_map": dict(_AUTO_MAP),
            "model_type": "openvla",
            "vision_backbone_id": "dinosiglip-vit-so-224px",
            "llm_backbone_id": "llama2-7b-pure",
            "hf_llm_id": "meta-llama/Llama-2-7b-hf",
            "arch_specifier": "no-align+fused-gelu-mlp",
            "use_fused_vision_backbone": True,
            "image_resize_strategy": "resize-naive",
            "image_sizes": [v.image_size for v in self.vision],
            "timm_model_ids": list(self.timm_model_ids),
            "timm_override_act_layers": [None, None],
            "llm_max_length": self.llm_max_length,
            "pad_token_id": self.pad_token_id,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "n_action_bins": self.n_action_bins,
            "output_projector_states": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1",
            "text_config": text_config,
            "norm_stats": copy.deepcopy(self.norm_stats),
        }
        if any(i.split(".")[0] not in TIMM_TOWERS for i in self.timm_model_ids):
            d["vision_configs"] = [
                {**v.to_dict(), "mean": list(m), "std": list(s)}
                for v, m, s in zip(self.vision, self.image_mean, self.image_std)
            ]
        if self.tokenizer != "llama2":
            d["parallax_tokenizer"] = self.tokenizer
        return {**d, **self._oft_dict()}

    def _oft_dict(self) -> dict:
        """``{"parallax_oft": ...}`` for an OFT model (how parallax rebuilds its head and
        inputs from config.json; OpenVLA's own loader ignores the key), else nothing."""
        return {} if self.oft is None else {"parallax_oft": self.oft.to_dict()}


def _presets() -> dict[str, OpenVLAConfig]:
    tiny_pair, small_pair = small_towers()
    llama_7b = replace(LLAMA_DEFAULTS, vocab_size=32064)
    return {
        "openvla-7b": OpenVLAConfig(
            vision=(DINOV2_L_REG4, SIGLIP_SO400M),
            text=llama_7b,
            timm_model_ids=(
                "vit_large_patch14_reg4_dinov2.lvd142m",
                "vit_so400m_patch14_siglip_224",
            ),
        ),
        "small": OpenVLAConfig(
            vision=small_pair,
            text=replace(
                llama_7b,
                hidden_size=512,
                intermediate_size=1376,
                num_hidden_layers=8,
                num_attention_heads=8,
            ),
            timm_model_ids=("parallax-small-dinov2-reg4", "parallax-small-siglip"),
        ),
        "tiny": OpenVLAConfig(
            vision=tiny_pair,
            text=replace(TINY_LLAMA, vocab_size=576, num_hidden_layers=4),
            timm_model_ids=("parallax-tiny-dinov2-reg4", "parallax-tiny-siglip"),
            pad_token_id=512,
            tokenizer="tiny",
        ),
    }


PRESETS = _presets()
OpenVLAConfig.PRESETS = PRESETS

"""Pi0Config: the architecture of a pi0 or pi0.5 policy (``shared/pi0.md``), from a preset or a
LeRobot policy folder.

Both variants share the SigLIP tower, the projector, the Gemma prefix model and the Gemma action
expert; they differ in how the state and the flow-matching time enter (``variant``). Widths and
depths are plain fields: LeRobot's ``config.json`` names only the Gemma variants, so a checkpoint
reader fills them from the tensors' shapes (:mod:`parallax.families.pi0.checkpoint`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from parallax.models.config_file import ConfigFile
from parallax.models.vit_config import ViTConfig

VARIANTS = ("pi0", "pi05")
MASK_VALUE = -2.3819763e38  # openpi's additive mask value: finite, so masked rows stay finite


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma stream: ``heads`` query heads and ``kv_heads`` (1: multi-query) of
    ``head_dim`` each; ``vocab_size`` 0 for a stream without token embeddings (the expert)."""

    width: int
    depth: int
    heads: int = 8
    kv_heads: int = 1
    head_dim: int = 256
    mlp_hidden: int = 16384
    vocab_size: int = 0
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"GemmaConfig: {self.heads} query heads do not split into {self.kv_heads} "
                "key/value groups"
            )


def siglip_so400m(image_size: int = 224) -> ViTConfig:
    """PaliGemma's SigLIP-So400m/14: 256 patch tokens, post-layernorm, no pooling head."""
    return ViTConfig(
        image_size=image_size,
        patch_size=14,
        width=1152,
        depth=27,
        num_heads=16,
        mlp_hidden=4304,
        class_token=False,
        final_norm=True,
        act="gelu_tanh",
        pool="none",
    )


@dataclass
class Pi0Config(ConfigFile):
    """A pi0 (``variant="pi0"``) or pi0.5 (``"pi05"``) policy.

    ``chunk``: actions per chunk (the horizon); ``max_action_dim`` / ``max_state_dim``: the
    padded widths actions and state take in the model; ``num_cameras``: image slots of the
    prefix; ``text_length``: the prompt's fixed (right-padded) length; ``num_steps``: Euler
    steps of :func:`~parallax.families.pi0.predict.predict_action_chunk`.
    """

    PRESET_KIND = "pi0"

    variant: str
    vision: ViTConfig
    prefix: GemmaConfig
    expert: GemmaConfig
    chunk: int = 50
    max_action_dim: int = 32
    max_state_dim: int = 32
    num_cameras: int = 3
    text_length: int = 48
    num_steps: int = 10
    source: str | None = None
    lerobot: dict | None = None  # the config.json it was read from (written back with updates)

    def __post_init__(self) -> None:
        problems = []
        if self.variant not in VARIANTS:
            problems.append(f"variant {self.variant!r} is not one of {VARIANTS}")
        p, e = self.prefix, self.expert
        mine, its = (
            (p.depth, p.heads, p.kv_heads, p.head_dim),
            (e.depth, e.heads, e.kv_heads, e.head_dim),
        )
        if mine != its:
            problems.append(
                "the prefix model and the expert attend jointly, so they need the same depth "
                f"and attention shape: (depth, heads, kv_heads, head_dim) {mine} vs {its}"
            )
        if p.vocab_size < 1:
            problems.append(f"prefix vocab_size {p.vocab_size} < 1")
        for name in ("chunk", "max_action_dim", "max_state_dim", "num_cameras", "num_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} {getattr(self, name)} < 1")
        if problems:
            raise ValueError("Pi0Config: " + "; ".join(problems))

    @property
    def pi05(self) -> bool:
        return self.variant == "pi05"

    @property
    def depth(self) -> int:
        return self.prefix.depth

    @property
    def image_tokens(self) -> int:
        return self.vision.num_patches

    @property
    def prefix_length(self) -> int:
        """Tokens of the prefix: every camera's patches, then the prompt."""
        return self.num_cameras * self.image_tokens + self.text_length

    @property
    def suffix_length(self) -> int:
        """Tokens of the suffix: pi0's state token and the action tokens."""
        return self.chunk + (0 if self.pi05 else 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> Pi0Config:
        """A config written by :meth:`to_dict` (a LeRobot ``config.json`` is read by
        :func:`parallax.families.pi0.checkpoint.config_from_folder`)."""
        d = dict(d)
        d["vision"] = ViTConfig(**d["vision"])
        d["prefix"] = GemmaConfig(**d["prefix"])
        d["expert"] = GemmaConfig(**d["expert"])
        d["source"] = source if source is not None else d.get("source")
        return cls(**d)


GEMMA_2B = GemmaConfig(width=2048, depth=18, mlp_hidden=16384, vocab_size=257152)
GEMMA_300M = GemmaConfig(width=1024, depth=18, mlp_hidden=4096)
TINY_VISION = ViTConfig(  # 32 px: the synthetic task's objects span a few pixels; 16 patches
    image_size=32,
    patch_size=8,
    width=32,
    depth=2,
    num_heads=2,
    mlp_hidden=64,
    class_token=False,
    final_norm=True,
    act="gelu_tanh",
    pool="none",
)
TINY_PREFIX = GemmaConfig(width=64, depth=2, heads=4, head_dim=16, mlp_hidden=128, vocab_size=300)
TINY_EXPERT = GemmaConfig(width=32, depth=2, heads=4, head_dim=16, mlp_hidden=64)
_PI0 = Pi0Config("pi0", siglip_so400m(), GEMMA_2B, GEMMA_300M)
_TINY = Pi0Config(
    "pi0", TINY_VISION, TINY_PREFIX, TINY_EXPERT, chunk=4, max_action_dim=8, max_state_dim=8
)
_TINY = replace(_TINY, num_cameras=2, text_length=32)  # the byte prompt of a synthetic task
PRESETS = {
    "pi0": _PI0,
    "pi05": replace(_PI0, variant="pi05", text_length=200),
    "pi0-tiny": _TINY,
    "pi05-tiny": replace(_TINY, variant="pi05", text_length=64),  # and its state bins
}
Pi0Config.PRESETS = PRESETS

"""Shared pieces of the pi0 tests: a perturbed init that makes every parameter matter, and a
batch of inputs with an absent camera and a padded prompt."""

from __future__ import annotations

import torch

from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.model import Pi0Model
from parallax.init import init_parameters
from parallax.tensor import apply_lora

SEED = 1234


def perturbed_init(name: str, shape, gen: torch.Generator, device) -> torch.Tensor:
    """Every tensor random (1-D ones near zero around their constant), so each one counts."""
    std = 0.3 if len(shape) < 2 else shape[-1] ** -0.5
    x = torch.empty(shape, device=device).normal_(0.0, std, generator=gen)
    if len(shape) == 1 and name.startswith("vision") and "norm" in name and "weight" in name:
        x = x + 1.0  # LayerNorms scale around 1; Gemma's norms scale by 1 + w, w around 0
    return x


def tiny_model(variant: str, ctx=None, dtype=torch.float32, blocks=None) -> Pi0Model:
    """The tiny preset (the chunk of pipeline ``blocks``: a range of ``embed``, ``layers.i``)."""
    config = Pi0Config.preset(f"{variant}-tiny")
    model = Pi0Model(config, ctx, dtype=dtype, blocks=blocks)
    init_parameters(model, SEED, perturbed_init)
    return model


def inputs(config: Pi0Config, b: int = 2, seed: int = 3) -> dict[str, torch.Tensor]:
    """Images in [-1, 1] with sample 1's second camera absent, prompts of different lengths
    (sample 1's padded), a state, padded actions (the last two dims zero: 6 real ones)."""
    g = torch.Generator().manual_seed(seed)
    s, n, length = config.vision.image_size, config.num_cameras, config.text_length
    image_masks = torch.ones(b, n, dtype=torch.bool)
    image_masks[1, -1] = False
    token_mask = torch.ones(b, length, dtype=torch.bool)
    token_mask[1, length // 2 :] = False
    tokens = torch.randint(3, config.prefix.vocab_size, (b, length), generator=g)
    actions = torch.randn(b, config.chunk, config.max_action_dim, generator=g)
    actions[..., 6:] = 0
    return {
        "images": torch.rand(b, n, 3, s, s, generator=g) * 2 - 1,
        "image_masks": image_masks,
        "tokens": tokens * token_mask,
        "token_mask": token_mask,
        "state": None if config.pi05 else torch.randn(b, config.max_state_dim, generator=g),
        "actions": actions,
        "action_dim": 6,
        "noise": torch.randn(b, config.chunk, config.max_action_dim, generator=g),
        "time": torch.rand(b, generator=g) * 0.98 + 0.01,
    }


def lora_model(variant: str, ctx=None):
    """The tiny model with adapters on every linear, B drawn too (so A gets gradients)."""
    model = tiny_model(variant, ctx)
    apply_lora(model, rank=2, alpha=4.0, seed=SEED)
    init_parameters(model, SEED, perturbed_init)  # layout-free: the same at every tp
    return model

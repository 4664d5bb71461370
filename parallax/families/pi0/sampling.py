"""Sampling a chunk: Euler integration of the flow from given noise, over the cached prefix.

Start from ``x = noise`` at ``t = 1`` and take ``N`` steps ``x <- x + dt * v(x, t)`` with
``dt = -1/N`` (t accumulated in float32, as LeRobot does). The whole model fills the prefix's
cache once and runs the expert alone at every step; a pipeline stage's chunk walks its
neighbours (:mod:`.staged`). Apart from :mod:`.predict` (the policy API: raw images, text and
normalisation) so that the objective's evaluation samples without importing the batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parallax.families.pi0.staged import StagedVelocity


@torch.no_grad()
def sample_chunk(
    model,
    images: torch.Tensor,
    image_masks: torch.Tensor,
    tokens: torch.Tensor,
    token_mask: torch.Tensor,
    state: torch.Tensor | None,
    noise: torch.Tensor,
    num_steps: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """The chunk ``(b, H, A)`` float32 (padded action width) from ``noise`` (b, H, A)."""
    steps = num_steps or model.config.num_steps
    if steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {steps}")
    dt = -1.0 / steps
    b = noise.shape[0]
    velocity = _velocity(model, (images, image_masks, tokens, token_mask), state, use_cache)
    x = noise.float()  # (b, H, A)
    time = torch.tensor(1.0, dtype=torch.float32, device=noise.device)
    for _ in range(steps):
        x = x + dt * velocity(x, time.expand(b))  # t: (b,)
        time = time + dt
    return x


def _velocity(model, prefix, state, use_cache: bool) -> Callable:
    """``v(x, t)`` over the prefix: the cached prefix's (a pipeline stage's chunk: its layers,
    its neighbours over the pipeline group), or the whole model's recomputed each call."""
    if not (model.has_embed and model.has_head):
        return StagedVelocity(model, prefix, state)
    if not use_cache:
        return lambda x, t: model.velocity(*prefix, state, x, t)
    cache = model.fill_cache(*prefix)
    return lambda x, t: model.cached_velocity(cache, state, x, t)

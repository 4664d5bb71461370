"""Pure tensor collation of raw samples (tokenising and preprocessing live with the model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from parallax.data.episodes import Sample


def collate(samples: Sequence[Sample]) -> dict[str, Any]:
    """Stack a microbatch: ``{"image": (b, H, W, 3) uint8, "instruction": [b str],
    "action": (b, 7) float32}``."""
    if not samples:
        raise ValueError("cannot collate an empty microbatch")
    return {
        "image": torch.stack([s["image"] for s in samples]),  # (b, H, W, 3)
        "instruction": [s["instruction"] for s in samples],
        "action": torch.stack([s["action"] for s in samples]).to(torch.float32),  # (b, 7)
    }

"""A built-in visual question task that ``llava-tiny`` learns on a CPU in seconds.

Each sample is a noisy image of a coloured square on a grey background, in one of several sizes
and aspect ratios (so the AnyRes tile and token counts vary from sample to sample), with the
question "What colour is the square?" and the colour's name as the answer. The answer is only in
the pixels: a model that ignores the image answers at chance (1/4). A fraction of the samples
have no image ("Repeat the colour: blue." -> "blue"): their answer is in the text, so the model
must also read the question to tell the two kinds apart. Sample ``i`` comes from its own
generator seeded by ``(seed, i)``: any sample is computed on demand, the same seed always gives
the same data, and :meth:`SyntheticVQA.meta` tells a sample's image size and text without
drawing it. Items are raw LLaVA-format samples (:mod:`parallax.families.llava_next.conversations`).

Measured on a CPU with AdamW at 3e-3 and 16 samples per step: with the full ``vicuna_v1`` system
prompt (40 words before every question) ``llava-tiny`` answers about half of the questions after
80 steps; with a short ``system`` text (:class:`~parallax.models.LlavaNextProcessor`) it passes
90% within 60 steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 215, 40),
}
QUESTION = "What colour is the square?"
# (height, width) at scale 1: LLaVA-tiny's 28 px tiles, 3 to 5 tiles per image
SIZES = ((28, 28), (30, 40), (60, 20), (40, 30), (56, 56), (20, 80), (84, 30), (36, 48))


@dataclass(frozen=True)
class VQAConfig:
    """What the task looks like; ``image_scale`` multiplies every image size (12 for 336 px
    tiles)."""

    seed: int = 0
    num_samples: int = 1000
    image_sizes: tuple[tuple[int, int], ...] = SIZES
    image_scale: int = 1
    text_only_fraction: float = 0.1
    name: str = "parallax_vqa"

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.image_scale < 1 or not self.image_sizes:
            raise ValueError(f"VQAConfig: need num_samples, image_scale >= 1 and sizes; got {self}")
        if not 0.0 <= self.text_only_fraction <= 1.0:
            raise ValueError(f"VQAConfig: text_only_fraction must be in [0, 1], got {self}")


class SyntheticVQA:
    """Indexable raw samples ``{"id", "image", "conversations", "answer"}`` (see module doc)."""

    statistics: dict[str, Any] = {}

    def __init__(self, config: VQAConfig | None = None, **overrides: Any) -> None:
        self.config = replace(config or VQAConfig(), **overrides)  # a frozen copy
        self.name = self.config.name

    def __len__(self) -> int:
        return self.config.num_samples

    def _plan(self, index: int) -> dict[str, Any]:
        """Everything about sample ``index`` except its pixels."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, index])
        names = list(COLOURS)
        if rng.random() < cfg.text_only_fraction:
            colour = names[int(rng.integers(len(names)))]
            return {
                "rng": rng,
                "size": None,
                "question": f"Repeat the colour: {colour}.",
                "answer": colour,
            }
        h, w = cfg.image_sizes[int(rng.integers(len(cfg.image_sizes)))]
        colour = names[int(rng.integers(len(names)))]
        return {
            "rng": rng,
            "size": (h * cfg.image_scale, w * cfg.image_scale),
            "question": "<image>\n" + QUESTION,
            "answer": colour,
        }

    @staticmethod
    def _conversation(plan: dict) -> list[dict[str, str]]:
        return [
            {"from": "human", "value": plan["question"]},
            {"from": "gpt", "value": plan["answer"]},
        ]

    def meta(self, index: int) -> dict[str, Any]:
        plan = self._plan(index)
        return {
            "id": f"vqa-{index}",
            "image_size": plan["size"],
            "conversations": self._conversation(plan),
        }

    def __getitem__(self, index: int) -> dict[str, Any]:
        plan = self._plan(index)
        image = None if plan["size"] is None else self._render(plan)
        return {
            "id": f"vqa-{index}",
            "image": image,
            "conversations": self._conversation(plan),
            "answer": plan["answer"],
        }

    @staticmethod
    def _render(plan: dict) -> torch.Tensor:
        """(H, W, 3) uint8: a grey background, a square of 50-90 % of the short side, noise."""
        rng, (h, w) = plan["rng"], plan["size"]
        image = np.full((h, w, 3), rng.uniform(80.0, 170.0), dtype=np.float32)
        square = np.float32(COLOURS[plan["answer"]])
        side = max(2, int(rng.uniform(0.5, 0.9) * min(h, w)))
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        image[top : top + side, left : left + side] = square
        image += rng.uniform(-12.0, 12.0, image.shape).astype(np.float32)
        return torch.from_numpy(np.clip(image, 0, 255).round().astype(np.uint8))

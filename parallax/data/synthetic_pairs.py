"""The built-in synthetic image-text task: one coloured shape on a noisy background, captioned.

Each image shows one object of a colour (red, green, blue, yellow, purple, orange) and a shape
(square, circle, triangle) in one quadrant of the picture (top left, top right, bottom left,
bottom right), at a jittered size and place, over a random grey background with noise. Its
caption names the colour, the shape and, in two of three caption templates, the place, e.g.
``"a red circle at the top left"``. Matching images and captions needs colour, shape and place:
a tiny dual encoder learns it in a few hundred steps. For zero-shot classification the classes
are the 18 colour-shape pairs (:meth:`SyntheticPairs.class_names`, label in each sample).

Sample ``i`` of split ``"train"`` or ``"eval"`` comes from its own generator seeded by
``(seed, split, i)``: the splits are disjoint draws, and any sample is computed on demand.
"""

from __future__ import annotations

import numpy as np

from parallax.data.pairs import PairSample
from parallax.data.synthetic import COLOURS
from parallax.seeds import param_seed

SHAPES = ("square", "circle", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right")
TEMPLATES = (
    "a {colour} {shape}",
    "a {colour} {shape} at the {place}",
    "{place}: a {colour} {shape}",
)


class SyntheticPairs:
    """A pair source of ``size`` generated pairs (one shard)."""

    def __init__(
        self, seed: int = 0, size: int = 4096, image_size: int = 32, split: str = "train"
    ) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if image_size < 16:
            raise ValueError(f"image_size must be at least 16 pixels, got {image_size}")
        self.seed, self.size, self.image_size, self.split = seed, size, image_size, split
        self.name = f"synthetic-pairs-{split}"

    @staticmethod
    def class_names() -> list[str]:
        return [f"{c} {s}" for c in COLOURS for s in SHAPES]

    def num_shards(self) -> int:
        return 1

    def shard_length(self, shard: int) -> int:
        return self.size

    def __len__(self) -> int:
        return self.size

    def read(self, shard: int, index: int) -> PairSample:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} outside [0, {self.size})")
        rng = np.random.default_rng(param_seed(self.seed, f"pairs.{self.split}.{index}"))
        colour = int(rng.integers(len(COLOURS)))
        shape, place = int(rng.integers(len(SHAPES))), int(rng.integers(len(PLACES)))
        image = self._draw(rng, list(COLOURS.values())[colour], shape, place)
        names = dict(colour=list(COLOURS)[colour], shape=SHAPES[shape], place=PLACES[place])
        caption = TEMPLATES[int(rng.integers(len(TEMPLATES)))].format(**names)
        return {
            "image": image,
            "caption": caption,
            "key": f"{self.split}-{index:08d}",
            "label": colour * len(SHAPES) + shape,
        }

    def _draw(self, rng, rgb, shape: int, place: int) -> np.ndarray:
        s = self.image_size
        grey = rng.uniform(60, 200)
        img = grey + rng.normal(0, 12, size=(s, s, 3))
        half = s / 2
        r = rng.uniform(0.22, 0.36) * half  # radius of the object
        cy = (place // 2) * half + half / 2 + rng.uniform(-0.15, 0.15) * half
        cx = (place % 2) * half + half / 2 + rng.uniform(-0.15, 0.15) * half
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float64) + 0.5
        dy, dx = yy - cy, xx - cx
        if SHAPES[shape] == "square":
            mask = (np.abs(dy) <= r) & (np.abs(dx) <= r)
        elif SHAPES[shape] == "circle":
            mask = dy**2 + dx**2 <= r**2
        else:  # an upward triangle: apex at the top, base at the bottom
            mask = (dy <= r) & (dy >= -r) & (np.abs(dx) <= (dy + r) / 2)
        img[mask] = np.asarray(rgb, dtype=np.float64) + rng.normal(0, 8, size=(int(mask.sum()), 3))
        return np.clip(img, 0, 255).astype(np.uint8)

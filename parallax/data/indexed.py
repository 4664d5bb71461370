"""parallax's own datasets (an episode directory, the synthetic task) as streaming sources, so
one loader serves every ``--data``."""

from __future__ import annotations

from typing import Any

import numpy as np

from parallax.data.episodes import EpisodeDataset
from parallax.data.keys import DEFAULTS
from parallax.data.source import EpisodeRef, OpenEpisode, Source
from parallax.data.synthetic import SyntheticTask


def episode_lengths(dataset: Any) -> list[int]:
    """Steps per episode of a parallax dataset, in sample order."""
    if isinstance(dataset, EpisodeDataset):
        return [int(e["length"]) for e in dataset.episodes]
    if isinstance(dataset, SyntheticTask):
        return [dataset.samples_per_episode] * dataset.config.num_episodes
    lengths = getattr(dataset, "episode_lengths", None)
    if lengths is None:
        raise TypeError(f"{type(dataset).__name__} does not say how its samples form episodes")
    return [int(n) for n in lengths]


class IndexedSource(Source):
    """A random-access parallax dataset whose samples run through its episodes in order; its
    own statistics are kept (nothing to scan)."""

    format = "parallax"

    def __init__(self, dataset: Any) -> None:
        super().__init__(getattr(dataset, "path", dataset.name), dataset.name, DEFAULTS["parallax"])
        self.dataset = dataset
        self.name, self.statistics = dataset.name, dataset.statistics
        start = 0
        for k, length in enumerate(episode_lengths(dataset)):
            self.episodes.append(EpisodeRef(length, "", start, f"{self.path}: episode {k}", k))
            start += length
        self._ends = np.cumsum([e.length for e in self.episodes]).tolist()
        self.action_dim = len(next(iter(self.statistics.values()))["action"]["q01"])

    def open_episode(self, episode: int) -> OpenEpisode:
        ref = self.episodes[episode]
        samples = [self.dataset[ref.where + t] for t in range(ref.length)]
        actions = np.stack([np.asarray(s["action"], dtype=np.float32) for s in samples])
        images = [np.asarray(s["image"]) for s in samples]
        text = [s["instruction"] for s in samples]
        return _IndexedEpisode(self, ref, actions, None, text, 0, images)

    def camera_key(self, camera: str) -> str:
        return camera


class _IndexedEpisode(OpenEpisode):
    def __init__(self, source, ref, actions, states, text, front, images):
        super().__init__(source, ref, actions, states, text, front)
        self.images = images

    def raw_image(self, raw_step: int, key: str) -> np.ndarray:
        return self.images[raw_step]

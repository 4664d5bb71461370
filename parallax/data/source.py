"""What every format reader provides: an index of episodes scanned once (lengths, where each
episode lives, every action for the statistics), and episodes opened for reading samples.

Opening a source scans all its episodes' actions and states, never its images: that one pass
checks what can be checked before training (keys present, dimensions that agree between
episodes, a non-empty dataset, record checksums) and computes the action statistics. Reading
(:meth:`Source.open_episode`) happens in the loader's worker processes, so a source holds only
plain, picklable data; every file handle lives in an :class:`OpenEpisode`.

A raw sample is ``{"image": (H, W, 3) uint8, "instruction": str, "action": (D,) float32,
"dataset": name, "episode": int, "step": int}`` plus, when asked for, ``"wrist_image"``,
``"state": (S,) float32`` and the action chunk ``"actions": (K, D) float32`` (OpenVLA-OFT's
targets: :func:`parallax.data.chunks.chunk_lengths` says which steps are samples then).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from parallax.atomic import atomic_write_bytes
from parallax.data.chunks import SampleIndex, action_chunk
from parallax.data.keys import KeyConfig, transform_episode
from parallax.data.stats import DatasetError, check_finite, compute_statistics

log = logging.getLogger(__name__)
CAMERAS = ("primary", "wrist")
INDEX_VERSION = 2  # 2: episodes with non-finite actions or states are refused


@dataclass
class EpisodeRef:
    """One episode of a scanned source."""

    length: int  # samples, after the config's transform
    instruction: str  # the first step's
    where: Any  # the reader's locator (plain data)
    label: str  # how messages name it: "<file>: episode k (...)"
    index: int = 0  # its number in the source


class OpenEpisode:
    """An episode opened for reading: actions, states and instructions in memory, images
    decoded on demand (subclasses implement :meth:`raw_image`)."""

    def __init__(self, source: Source, ref: EpisodeRef, actions, states, instructions, front):
        self.source, self.ref = source, ref
        self.actions, self.states, self.front = actions, states, front
        self.instructions = instructions  # one per raw step, or one str for all

    def raw_image(self, raw_step: int, key: str) -> np.ndarray:
        """Camera ``key``'s frame at raw step ``raw_step``, (H, W, 3) uint8 RGB."""
        raise NotImplementedError

    def instruction(self, step: int) -> str:
        if isinstance(self.instructions, str):
            return self.instructions
        return self.instructions[step + self.front]

    def image(self, step: int, camera: str = "primary") -> np.ndarray:
        key = self.source.camera_key(camera)
        image = np.asarray(self.raw_image(step + self.front, key))
        if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
            raise DatasetError(
                f"{self.ref.label}: step {step}: {key!r} is {image.shape} {image.dtype}, "
                "not an (H, W, 3) uint8 RGB image"
            )
        if self.source.config.rotate180:
            image = image[::-1, ::-1]
        return np.ascontiguousarray(image)

    def close(self) -> None:
        """Release file handles (subclasses that hold some override this)."""


class Source:
    """A scanned dataset of one format (see the module doc). Subclasses scan in ``__init__``
    through :meth:`add_episode` and :meth:`finish`, and implement :meth:`open_episode`."""

    format: ClassVar[str] = ""

    def __init__(self, path: str | Path, name: str, config: KeyConfig) -> None:
        self.path = Path(path)
        self.config = config
        self.name = config.name or name
        self.episodes: list[EpisodeRef] = []
        self.action_dim: int | None = None
        self.state_dim: int | None = None
        self.image_shape: tuple[int, ...] | None = None  # as the metadata declares it, if it does
        self.statistics: dict[str, Any] = {}
        self._actions: list[np.ndarray] = []
        self._states: list[np.ndarray] = []
        self._first = ""

    # --- scanning -------------------------------------------------------------------------
    def prepare(self, raw_actions, raw_states, label: str):
        """Transform one episode's raw arrays and check their dimensions against the first
        episode's: ``(actions, states, first raw step kept)``."""
        actions = np.asarray(raw_actions, dtype=np.float32)
        if actions.ndim == 1:
            actions = actions[:, None]
        states = None if raw_states is None else np.asarray(raw_states, dtype=np.float32)
        if states is not None and states.ndim == 1:
            states = states[:, None]
        if actions.ndim != 2 or len(actions) == 0:
            raise DatasetError(f"{label}: no steps (actions of shape {actions.shape})")
        if states is not None and len(states) != len(actions):
            raise DatasetError(f"{label}: {len(actions)} actions but {len(states)} states")
        check_finite(actions, "action", label)
        if states is not None:
            check_finite(states, "state", label)
        try:
            actions, states, front = transform_episode(self.config, actions, states)
        except DatasetError as err:
            raise DatasetError(f"{label}: {err}") from None
        for what, dim, value in (
            ("action", self.action_dim, actions.shape[1]),
            ("state", self.state_dim, None if states is None else states.shape[1]),
        ):
            if self.episodes and dim != value:
                raise DatasetError(
                    f"{label}: {what} dimension {value} disagrees with {dim} of "
                    f"{self._first}; every episode of a dataset needs the same {what} size"
                )
        return actions, states, front

    def scan(self, files: list[Path], cache_dir: str | Path | None = None) -> None:
        """Scan the episodes (:meth:`scan_episodes`, then :meth:`finish`), or read the result
        of an earlier scan of the same files (names, sizes, times) and config from
        ``cache_dir``. One rank can scan and write it while the others wait and read it."""
        cache = None if cache_dir is None else Path(cache_dir) / self._index_name(files)
        if cache is not None and cache.is_file():
            try:
                return self._load_index(json.loads(cache.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("ignoring the unreadable scan index %s (%s)", cache, err)
        self.scan_episodes()
        self.finish()
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            index = {
                "version": INDEX_VERSION,
                "episodes": [[e.length, e.instruction, e.where, e.label] for e in self.episodes],
                "action_dim": self.action_dim,
                "state_dim": self.state_dim,
                "image_shape": self.image_shape,
                "statistics": self.statistics,
            }
            atomic_write_bytes(cache, json.dumps(index).encode())

    def scan_episodes(self) -> None:
        """Every episode through :meth:`add_episode` (subclasses)."""
        raise NotImplementedError

    def _index_name(self, files: list[Path]) -> str:
        stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        what = [self.format, str(self.path.resolve()), stats, dataclasses.asdict(self.config)]
        digest = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]
        return f"{self.format}-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.name)}-{digest}.json"

    def _load_index(self, index: dict[str, Any]) -> None:
        if index.get("version") != INDEX_VERSION:
            raise ValueError(f"index version {index.get('version')}")
        self.episodes = [
            EpisodeRef(n, text, where, label, k)
            for k, (n, text, where, label) in enumerate(index["episodes"])
        ]
        self.action_dim, self.state_dim = index["action_dim"], index["state_dim"]
        shape = index["image_shape"]
        self.image_shape = None if shape is None else tuple(shape)
        self.statistics = index["statistics"]
        self._ends = np.cumsum([e.length for e in self.episodes]).tolist()

    def add_episode(self, where: Any, raw_actions, raw_states, instruction: str, label: str):
        actions, states, _ = self.prepare(raw_actions, raw_states, label)
        if not self.episodes:
            self.action_dim = actions.shape[1]
            self.state_dim = None if states is None else states.shape[1]
            self._first = label
        ref = EpisodeRef(len(actions), str(instruction), where, label, len(self.episodes))
        self.episodes.append(ref)
        self._actions.append(actions)
        if states is not None:
            self._states.append(states)

    def finish(self) -> None:
        """Close the scan: an empty dataset is an error; compute the statistics."""
        if not self.episodes:
            raise DatasetError(f"dataset {self.path} is empty: it holds no episodes")
        actions = np.concatenate(self._actions)
        states = np.concatenate(self._states) if self._states else None
        mask = self.config.mask(actions.shape[1])
        self.statistics = compute_statistics(
            actions, len(self.episodes), self.name, mask=mask, states=states
        )
        self._actions, self._states = [], []
        self._ends = np.cumsum([e.length for e in self.episodes]).tolist()

    # --- reading --------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        return np.array([e.length for e in self.episodes], dtype=np.int64)

    @property
    def num_transitions(self) -> int:
        return int(self._ends[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(episode, step) of sample ``index`` counted through the episodes in order."""
        if not 0 <= index < self.num_transitions:
            raise IndexError(f"sample {index} out of range for {self.num_transitions} samples")
        episode = bisect.bisect_right(self._ends, index)
        return episode, index - (self._ends[episode - 1] if episode else 0)

    def camera_key(self, camera: str) -> str:
        """The dataset key of ``camera``: ``primary``, ``wrist`` or ``extraK`` (the K-th of the
        config's ``extra`` cameras)."""
        named = {"primary": self.config.primary, "wrist": self.config.wrist}
        named.update({f"extra{k}": key for k, key in enumerate(self.config.extra)})
        key = named.get(camera)
        if key is None:
            raise DatasetError(f"dataset {self.name!r} has no {camera!r} camera in its config")
        return key

    def open_episode(self, episode: int) -> OpenEpisode:
        raise NotImplementedError

    def sample(
        self,
        opened: OpenEpisode,
        step: int,
        cameras=("primary",),
        state: bool = False,
        chunk: int = 1,
    ) -> dict[str, Any]:
        """One raw sample (numpy arrays; see the module doc); ``chunk > 1`` adds ``"actions"``
        ``(chunk, D)``, the next ``chunk`` actions (:func:`~parallax.data.chunks.action_chunk`)."""
        out: dict[str, Any] = {
            "image": opened.image(step, "primary"),
            "instruction": opened.instruction(step),
            "action": opened.actions[step],
            "dataset": self.name,
            "episode": opened.ref.index,
            "step": step,
        }
        if "wrist" in cameras and self.config.wrist is not None:
            out["wrist_image"] = opened.image(step, "wrist")
        if state and opened.states is not None:
            out["state"] = opened.states[step]
        if chunk > 1:
            out["actions"] = action_chunk(opened.actions, step, chunk)
        return out

    def __repr__(self) -> str:
        n = len(self.episodes)
        return f"{type(self).__name__}({self.name!r}, {n} episodes, {self.path})"


class SourceDataset:
    """Random access to a source's samples (the :class:`~parallax.data.Dataset` protocol), for
    the plain :class:`~parallax.data.BatchLoader`: a few recently used episodes stay open. With
    ``chunk > 1`` every sample also carries the next ``chunk`` actions (``"actions"``, OFT's
    rule: :mod:`parallax.data.chunks`)."""

    def __init__(self, source: Source, max_open: int = 8, chunk: int = 1) -> None:
        self.source, self.chunk = source, chunk
        self.name, self.statistics = source.name, source.statistics
        self.index = SampleIndex(source.lengths, chunk, f"dataset {source.name!r}")
        self._max_open = max_open
        self._open: OrderedDict[int, OpenEpisode] = OrderedDict()

    def __len__(self) -> int:
        return len(self.index)

    def opened(self, episode: int) -> OpenEpisode:
        """Episode ``episode`` opened (kept among the most recently used)."""
        opened = self._open.pop(episode, None) or self.source.open_episode(episode)
        self._open[episode] = opened
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)[1].close()
        return opened

    def __getitem__(self, index: int) -> dict[str, Any]:
        episode, step = self.index.locate(int(index))
        raw = self.source.sample(self.opened(episode), step, chunk=self.chunk)
        return {
            **raw,
            "image": torch.from_numpy(raw["image"].copy()),
            "action": torch.from_numpy(np.array(raw["action"], dtype=np.float32)),
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": OrderedDict()}

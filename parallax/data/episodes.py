"""The on-disk episode format: write a dataset directory, and read it back sample by sample.

A dataset directory::

    my_dataset/
      dataset_statistics.json     OpenVLA norm_stats: {"<name>": {"action": {...}, ...}}
      index.json                  {"format": "parallax-episodes", "version": 1, "name": "<name>",
                                   "image_shape": [H, W, 3], "action_dim": 7,
                                   "num_episodes": E, "num_transitions": N,
                                   "episodes": [{"file": "episodes/episode_000000.safetensors",
                                                 "length": T, "instruction": "pick up the cup"},
                                                ...]}
      episodes/episode_000000.safetensors    "images": (T, H, W, 3) uint8 RGB
                                             "actions": (T, 7) float32
      ...

Every episode holds one instruction and ``T >= 1`` steps; step ``t``'s action is what the
robot did after seeing image ``t``. All images of a dataset share one shape. Samples are
numbered through the episodes in index order (episode 0's steps, then episode 1's...). Actions
are stored raw; ``dataset_statistics.json`` carries what a model needs to normalise them
(q01/q99, mask). The directory is written under a temporary name and renamed into place once
complete, and contains no pickle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallax.atomic import as_created, fsync_dir, fsync_file, publish_dir, temp_sibling
from parallax.checkpoint.reader import read_json
from parallax.checkpoint.stream import CheckpointError, read_header
from parallax.data.chunks import SampleIndex
from parallax.data.stats import (
    DatasetError,
    check_finite,
    check_statistics,
    compute_statistics,
)

log = logging.getLogger(__name__)

FORMAT = "parallax-episodes"
VERSION = 1
INDEX = "index.json"
STATISTICS = "dataset_statistics.json"
Sample = dict[str, Any]  # {"image": (H, W, 3) uint8, "instruction": str, "action": (7,) float32}


@dataclass
class Episode:
    """One episode in memory: the unit the writer takes (tensors, or numpy arrays, which it
    takes as tensors)."""

    images: torch.Tensor  # (T, H, W, 3) uint8
    actions: torch.Tensor  # (T, D) float32
    instruction: str

    def __post_init__(self) -> None:
        self.images = torch.as_tensor(self.images)
        self.actions = torch.as_tensor(self.actions)


def _check_episode(ep: Episode, k: int, image_shape: tuple | None, action_dim: int | None):
    images, actions = ep.images, ep.actions
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise DatasetError(
            f"episode {k}: images must be (T, H, W, 3) uint8, got {tuple(images.shape)} "
            f"{images.dtype}"
        )
    if actions.ndim != 2 or actions.shape[0] != images.shape[0] or actions.shape[0] == 0:
        raise DatasetError(
            f"episode {k}: actions must be (T, D) with T = {images.shape[0]} images (T >= 1), "
            f"got {tuple(actions.shape)}"
        )
    if image_shape is not None and tuple(images.shape[1:]) != image_shape:
        raise DatasetError(
            f"episode {k}: image shape {tuple(images.shape[1:])} differs from the first "
            f"episode's {image_shape}; resize them to one shape (convert --image-size)"
        )
    if action_dim is not None and actions.shape[1] != action_dim:
        raise DatasetError(f"episode {k}: action dim {actions.shape[1]}, expected {action_dim}")
    if not isinstance(ep.instruction, str) or not ep.instruction.strip():
        raise DatasetError(f"episode {k}: instruction must be a non-empty string")
    check_finite(actions.float().numpy(), "action", f"episode {k}")


def write_dataset(
    out_dir: str | Path, episodes: Iterable[Episode], name: str, overwrite: bool = False
) -> Path:
    """Write ``episodes`` (streamed, one in memory at a time) as a dataset directory.

    Statistics are computed from every action written. The directory appears only once
    complete; an existing non-empty ``out_dir`` is an error unless ``overwrite``.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(
            f"{out} already exists and is not empty (pass overwrite=True to replace it)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out)
    (tmp / "episodes").mkdir(parents=True)
    try:
        entries, all_actions = [], []
        image_shape = action_dim = None
        for k, ep in enumerate(episodes):
            _check_episode(ep, k, image_shape, action_dim)
            image_shape, action_dim = tuple(ep.images.shape[1:]), ep.actions.shape[1]
            file = f"episodes/episode_{k:06d}.safetensors"
            actions = ep.actions.to(torch.float32).contiguous()
            save_file({"images": ep.images.contiguous(), "actions": actions}, str(tmp / file))
            as_created(tmp / file)  # save_file writes 0600
            fsync_file(tmp / file)
            length = int(actions.shape[0])
            entries.append({"file": file, "length": length, "instruction": ep.instruction})
            all_actions.append(actions.numpy())
        if not entries:
            raise DatasetError(f"no episodes to write to {out}")
        stats = compute_statistics(np.concatenate(all_actions), len(entries), name)
        index = {
            "format": FORMAT,
            "version": VERSION,
            "name": name,
            "image_shape": list(image_shape),
            "action_dim": action_dim,
            "num_episodes": len(entries),
            "num_transitions": stats[name]["num_transitions"],
            "episodes": entries,
        }
        for fname, obj in ((INDEX, index), (STATISTICS, stats)):
            (tmp / fname).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
            fsync_file(tmp / fname)
        fsync_dir(tmp / "episodes")
        fsync_dir(tmp)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %d episodes (%d samples) to %s", len(entries), index["num_transitions"], out)
    return out


def _read_json(path: Path, what: str) -> Any:
    missing = f" ({what}); is it a dataset directory?"
    return read_json(path, DatasetError, missing, "cannot be read as JSON")


class EpisodeDataset:
    """Random access to the samples of a dataset directory (see module doc).

    Opening checks everything that can be checked cheaply (index, statistics, every episode
    file's safetensors header against the index), so a bad dataset fails before training.
    Images are read lazily, one step at a time, through a few cached memory maps. With
    ``chunk > 1`` every sample also carries the next ``chunk`` actions (``"actions"``
    ``(chunk, D)``, OpenVLA-OFT's rule: :mod:`parallax.data.chunks`).
    """

    def __init__(self, path: str | Path, max_open_files: int = 16, chunk: int = 1) -> None:
        self.path, self.chunk = Path(path), chunk
        if not self.path.is_dir():
            raise DatasetError(
                f"dataset directory {self.path} does not exist; pass 'synthetic' for the "
                "built-in task, or write one with `python -m parallax.data.convert`"
            )
        index = _read_json(self.path / INDEX, "the episode index")
        self.statistics = _read_json(self.path / STATISTICS, "the action statistics")
        stats_name = check_statistics(self.statistics, str(self.path / STATISTICS))
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise DatasetError(f"{self.path / INDEX}: not a {FORMAT!r} index")
        self.name = index.get("name", stats_name)
        if self.name != stats_name:
            raise DatasetError(
                f"{self.path}: index names dataset {self.name!r}, statistics {stats_name!r}"
            )
        self.episodes: list[dict[str, Any]] = index.get("episodes") or []
        if not self.episodes:
            raise DatasetError(f"dataset {self.path} is empty: its index lists no episodes")
        self.image_shape = tuple(index["image_shape"])
        self.action_dim = int(index["action_dim"])
        stats_dim = len(self.statistics[stats_name]["action"]["q01"])
        if stats_dim != self.action_dim:
            raise DatasetError(
                f"{self.path}: {INDEX} says the actions have {self.action_dim} dimensions, "
                f"{STATISTICS} has statistics of {stats_dim}; write the dataset again "
                "(python -m parallax.data.convert)"
            )
        for k, entry in enumerate(self.episodes):
            self._check_file(k, entry)
        lengths = [e["length"] for e in self.episodes]
        self.index = SampleIndex(lengths, chunk, f"dataset {self.path}")
        self._max_open = max_open_files
        self._open: OrderedDict[int, Any] = OrderedDict()

    def _check_file(self, k: int, entry: dict[str, Any]) -> None:
        file = self.path / entry["file"]
        try:
            header = read_header(file)
        except CheckpointError as err:
            raise DatasetError(f"episode {k}: {err}") from None
        t = int(entry["length"])
        want = {"images": [t, *self.image_shape], "actions": [t, self.action_dim]}
        got = {name: header.get(name, {}).get("shape") for name in want}
        if t < 1 or got != want:
            raise DatasetError(f"episode {k} ({file}): expected shapes {want}, found {got}")

    def __len__(self) -> int:
        return len(self.index)

    def locate(self, index: int) -> tuple[int, int]:
        """(episode, step) of sample ``index``."""
        return self.index.locate(index)

    def _handle(self, episode: int):
        handle = self._open.pop(episode, None)
        if handle is None:
            handle = safe_open(str(self.path / self.episodes[episode]["file"]), framework="pt")
            if len(self._open) >= self._max_open:
                self._open.popitem(last=False)
        self._open[episode] = handle
        return handle

    def __getitem__(self, index: int) -> Sample:
        episode, step = self.locate(int(index))
        handle = self._handle(episode)
        actions = handle.get_slice("actions")[step : step + self.chunk]  # (K, D) float32
        if not torch.isfinite(actions).all():  # a dataset written before writers checked
            bad = step + int((~torch.isfinite(actions)).any(-1).nonzero()[0])
            raise DatasetError(
                f"{self.path}: episode {episode} ({self.episodes[episode]['file']}), step "
                f"{bad}: the action {actions[bad - step].tolist()} is not finite (NaN or inf)"
            )
        sample = {
            "image": handle.get_slice("images")[step : step + 1][0],  # (H, W, 3) uint8
            "instruction": self.episodes[episode]["instruction"],
            "action": actions[0],  # (D,)
            "dataset": self.name,
        }
        if self.chunk > 1:
            sample["actions"] = actions  # (K, D): the chunk lies inside the episode
        return sample

    def __getstate__(self) -> dict[str, Any]:  # picklable for worker processes: drop the maps
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._open.clear()

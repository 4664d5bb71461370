"""LIBERO's HDF5 demonstrations, as its suites ship them (``libero_spatial/*_demo.hdf5``, ...).

One file per task; its demos are ``data/demo_N`` (taken in the order of N) with
``obs/agentview_rgb`` and ``obs/eye_in_hand_rgb`` ((T, H, W, 3) uint8), ``obs/ee_states``
(T, 6), ``obs/gripper_states`` (T, 2), ``obs/joint_states`` (T, 7) and ``actions`` (T, 7; the
gripper -1 open / +1 close). The simulator renders frames upside down: the default config turns
them by 180 degrees (as OpenVLA's LIBERO preprocessing does) and maps the gripper to 1 = open,
0 = closed (clip to [0, 1], then invert, as OpenVLA's ``libero_dataset_transform``).

The instruction is the task's ``language_instruction`` in the JSON attribute
``data.attrs["problem_info"]``; files without it (OpenVLA's regenerated ones) fall back to
LIBERO's own rule for its file names: drop ``_demo.hdf5`` and, for the scene-prefixed LIBERO-100
names (``KITCHEN_SCENE3_turn_on_the_stove``), everything up to the scene number, then turn
underscores into spaces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from parallax.data.extras import require
from parallax.data.keys import KeyConfig, resolve_config
from parallax.data.source import EpisodeRef, OpenEpisode, Source
from parallax.data.stats import DatasetError


def _h5py():
    return require("h5py", "libero", "reading LIBERO HDF5 files")


def find_libero_files(path: str | Path) -> list[Path]:
    """The HDF5 files of a suite: ``path`` itself, the files in it, or in its one subfolder."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DatasetError(f"LIBERO dataset {path} does not exist")
    files = sorted(path.glob("*.hdf5"))
    if files:
        return files
    below = sorted({p.parent for p in path.glob("*/*.hdf5")})
    if len(below) == 1:
        return sorted(below[0].glob("*.hdf5"))
    found = ", ".join(d.name for d in below) or "none"
    raise DatasetError(f"{path}: no .hdf5 files here or in one subfolder (found: {found})")


def instruction_from_filename(name: str) -> str:
    """LIBERO's instruction for a task file name (see the module doc)."""
    stem = re.sub(r"(_demo)?\.hdf5$", "", name)
    if stem[:1].isupper() and "SCENE" in stem:
        match = re.search(r"SCENE\d+_", stem)
        stem = stem[match.end() :] if match else stem
    return stem.replace("_", " ")


def file_instruction(handle, path: Path) -> str:
    info = handle["data"].attrs.get("problem_info") if "data" in handle else None
    if info is not None:
        try:
            text = json.loads(info if isinstance(info, str) else bytes(info).decode())
            text = text["language_instruction"]
            text = " ".join(text) if isinstance(text, list) else str(text)
            if text.strip():
                return text.strip().strip('"')
        except (ValueError, KeyError, TypeError):
            pass
    return instruction_from_filename(path.name)


def _demos(handle, path: Path) -> list[str]:
    if "data" not in handle:
        raise DatasetError(f"{path}: no 'data' group; is it a LIBERO demonstration file?")
    names = [k for k in handle["data"] if re.fullmatch(r"demo_\d+", k)]
    return sorted(names, key=lambda k: int(k.split("_")[1]))


class LiberoSource(Source):
    """A LIBERO suite folder (or one task file) of HDF5 demos (see the module doc)."""

    format = "libero"

    def __init__(
        self,
        path: str | Path,
        *,
        config: KeyConfig | None = None,
        user_configs: dict[str, KeyConfig] | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.files = find_libero_files(path)
        root = Path(path)
        name = root.stem if root.is_file() else self.files[0].parent.name
        cfg, _ = resolve_config("libero", name, user_configs, config)
        super().__init__(root, name, cfg)
        self.scan(self.files, cache_dir)

    def scan_episodes(self) -> None:
        cfg, h5py = self.config, _h5py()
        for file_index, file in enumerate(self.files):
            try:
                handle = h5py.File(file, "r")
            except OSError as err:
                raise DatasetError(f"{file}: not a readable HDF5 file ({err})") from None
            with handle:
                instruction = file_instruction(handle, file)
                for demo in _demos(handle, file):
                    label = f"{file}: episode {len(self.episodes)} (data/{demo})"
                    group = handle["data"][demo]
                    actions, states = self.arrays(group, label)
                    for key in {cfg.primary, cfg.wrist} - {None}:
                        shape = self._dataset(group, key, label).shape
                        if shape[0] != len(actions):
                            raise DatasetError(
                                f"{label}: {shape[0]} {key} frames, {len(actions)} actions"
                            )
                        self.image_shape = tuple(shape[1:])
                    where = (file_index, demo)
                    self.add_episode(where, actions, states, instruction, label)

    @staticmethod
    def _dataset(group, key: str, label: str):
        if key not in group:
            raise DatasetError(f"{label}: missing key {key!r}; the demo has {sorted(group.keys())}")
        return group[key]

    def arrays(self, group, label: str):
        """Raw actions and states of one demo group."""
        parts = {}
        for what, keys in (("action", self.config.action), ("state", self.config.state)):
            values = [np.asarray(self._dataset(group, k, label)[()], np.float32) for k in keys]
            values = [v[:, None] if v.ndim == 1 else v for v in values]
            if len({len(v) for v in values}) > 1:
                raise DatasetError(f"{label}: the {what} keys {keys} disagree on the steps")
            parts[what] = np.concatenate(values, axis=1) if values else None
        return parts["action"], parts["state"]

    def open_episode(self, episode: int) -> OpenEpisode:
        return _LiberoEpisode(self, self.episodes[episode])


class _LiberoEpisode(OpenEpisode):
    def __init__(self, source: LiberoSource, ref: EpisodeRef) -> None:
        file_index, demo = ref.where
        self.handle = _h5py().File(source.files[file_index], "r")
        self.group = self.handle["data"][demo]
        raw = source.arrays(self.group, ref.label)
        actions, states, front = source.prepare(*raw, ref.label)
        super().__init__(source, ref, actions, states, ref.instruction, front)

    def raw_image(self, raw_step: int, key: str) -> np.ndarray:
        return self.group[key][raw_step]

    def close(self) -> None:
        self.handle.close()

"""RLDS datasets as TFDS writes them (Open X-Embodiment, OpenVLA's LIBERO sets), read without
TensorFlow.

A dataset directory (``<name>/<version>/``) holds ``features.json`` (the TFDS ``FeaturesDict``
as JSON: each feature's shape, dtype and image encoding), ``dataset_info.json`` (the name, and
per split the number of episodes in each shard) and the shards
``<name>-train.tfrecord-00000-of-000NN``. Each record is one episode, a ``tf.train.Example``
whose keys flatten the nested features, with every step's values concatenated:
``steps/action`` (T x 7 floats), ``steps/observation/image`` (T encoded JPEG or PNG images),
``steps/language_instruction`` (T strings), ``steps/is_first`` (T int64), ...

Opening scans every record once (checksums verified, actions and states parsed, images left
encoded) and remembers where each episode lives; a worker re-reads one record to serve its
samples and decodes only the frames it is asked for.
"""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from parallax.data.extras import require
from parallax.data.keys import OPTIONAL_IN_DEFAULTS, KeyConfig, resolve_config
from parallax.data.source import OpenEpisode, Source
from parallax.data.stats import DatasetError
from parallax.data.tfrecord import iter_records, parse_example, read_record

log = logging.getLogger(__name__)
STEPS = "steps/"


def find_rlds_dir(path: str | Path) -> Path:
    """The directory holding ``features.json``: ``path`` itself, or its newest version folder
    (``path`` may be the dataset's folder above ``1.0.0/``)."""
    path = Path(path)
    if (path / "features.json").is_file():
        return path
    if path.is_dir():
        found = [d for d in path.iterdir() if d.is_dir() and (d / "features.json").is_file()]
        if found:
            version = lambda d: [int(t) if t.isdigit() else -1 for t in re.split(r"\D+", d.name)]  # noqa: E731
            return max(found, key=lambda d: (version(d), d.name))
    raise DatasetError(
        f"{path}: no features.json here or in a subfolder; is it an RLDS (TFDS) dataset "
        "directory (the folder of the .tfrecord shards, or its parent)?"
    )


def flatten_features(node: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """``features.json`` -> ``{"steps/observation/image": {"kind": "image", "shape": (256,
    256, 3), "dtype": "uint8", "encoding": "jpeg"}, ...}`` (the Example's flat keys)."""
    if "featuresDict" in node:
        out: dict[str, dict[str, Any]] = {}
        for name, child in node["featuresDict"].get("features", {}).items():
            out.update(flatten_features(child, f"{prefix}{name}/"))
        return out
    if "sequence" in node:  # a Dataset / Sequence: its feature's keys, values per step
        return flatten_features(node["sequence"]["feature"], prefix)
    key = prefix.rstrip("/")
    for kind in ("image", "tensor"):
        if kind in node:
            spec = node[kind]
            dims = spec.get("shape", {}).get("dimensions", [])
            return {
                key: {
                    "kind": kind,
                    "shape": tuple(int(d) for d in dims),
                    "dtype": spec.get("dtype", "uint8" if kind == "image" else "float32"),
                    "encoding": spec.get("encodingFormat", spec.get("encoding", "none")),
                }
            }
    if "text" in node:
        return {key: {"kind": "text", "shape": (), "dtype": "string", "encoding": "utf-8"}}
    return {key: {"kind": node.get("pythonClassName", "unknown"), "shape": (), "dtype": "?"}}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DatasetError(f"{path}: cannot be read as JSON ({err})") from None


def _steps(values: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A flat per-episode value list -> (T, *shape) (scalars -> (T, 1))."""
    width = int(np.prod(shape)) if shape and all(d > 0 for d in shape) else 1
    if values.size % width:
        raise DatasetError(f"{where}: {values.size} values do not split into steps of {shape}")
    return values.reshape(-1, *(shape if shape and width > 1 else (1,)))


class RLDSSource(Source):
    """An RLDS dataset directory (see the module doc), one split of it."""

    format = "rlds"

    def __init__(
        self,
        path: str | Path,
        *,
        config: KeyConfig | None = None,
        user_configs: dict[str, KeyConfig] | None = None,
        split: str = "train",
        cache_dir: str | Path | None = None,
    ) -> None:
        root = find_rlds_dir(path)
        info = (
            _read_json(root / "dataset_info.json") if (root / "dataset_info.json").is_file() else {}
        )
        name = info.get("name") or root.parent.name
        cfg, is_default = resolve_config("rlds", name, user_configs, config)
        self.features = flatten_features(_read_json(root / "features.json"))
        if is_default:  # drop optional keys this dataset lacks
            drop = {
                k: (None if k == "wrist" else ())
                for k in OPTIONAL_IN_DEFAULTS
                if any(STEPS + key not in self.features for key in _as_keys(getattr(cfg, k)))
            }
            cfg = cfg.replace(**drop)
        super().__init__(root, name, cfg)
        self.shards = sorted(root.glob(f"*-{split}.tfrecord-*")) or sorted(root.glob("*.tfrecord*"))
        if not self.shards:
            raise DatasetError(f"dataset {root} is empty: no {split!r} .tfrecord shards")
        declared = next((s for s in info.get("splits", []) if s.get("name") == split), {})
        self._declared = [int(n) for n in declared.get("shardLengths", [])]
        image = self.features.get(STEPS + (cfg.primary or ""), {})
        self.image_shape = image.get("shape") or None
        self.scan([*self.shards, root / "features.json"], cache_dir)

    def scan_episodes(self) -> None:
        lengths = self._declared
        for shard_index, shard in enumerate(self.shards):
            count = self._scan_shard(shard_index, shard)
            if len(lengths) == len(self.shards) and count != lengths[shard_index]:
                raise DatasetError(
                    f"{shard}: truncated shard: dataset_info.json declares "
                    f"{lengths[shard_index]} episodes, the file holds {count}"
                )

    def _scan_shard(self, shard_index: int, shard: Path) -> int:
        count = 0
        for record, offset, data in iter_records(shard):
            label = f"{shard}: record {record} (episode {len(self.episodes)})"
            arrays = self.episode_arrays(parse_example(data, label), label)
            where = (shard_index, offset, record)
            self.add_episode(where, arrays["action"], arrays["state"], arrays["text"][0], label)
            count += 1
        return count

    def _feature(self, feats: dict[str, Any], key: str, label: str):
        full = STEPS + key
        if full not in feats:
            have = sorted(k for k in feats if k.startswith(STEPS))
            raise DatasetError(f"{label}: missing key {full!r}; the episode has {have}")
        return feats[full]

    def episode_arrays(self, feats: dict[str, Any], label: str) -> dict[str, Any]:
        """Raw actions, states and per-step instructions of one parsed record."""
        cfg, out = self.config, {}
        for what, keys in (("action", cfg.action), ("state", cfg.state)):
            parts = []
            for key in keys:
                values = self._feature(feats, key, label)
                if isinstance(values, list):
                    raise DatasetError(f"{label}: {STEPS + key!r} holds bytes, not numbers")
                shape = self.features.get(STEPS + key, {}).get("shape", ())
                parts.append(_steps(values.astype(np.float32), shape, f"{label}: {key}"))
            lengths = {len(p) for p in parts}
            if len(lengths) > 1:
                raise DatasetError(f"{label}: the {what} keys {keys} disagree on the steps")
            out[what] = np.concatenate(parts, axis=1) if parts else None
        for key in (cfg.primary, cfg.wrist):
            frames = None if key is None else self._feature(feats, key, label)
            if frames is not None and len(frames) != len(out["action"]):
                raise DatasetError(
                    f"{label}: {len(frames)} {key!r} frames for {len(out['action'])} steps"
                )
        if cfg.instruction is None:
            out["text"] = [""] * len(out["action"])
        else:
            raw = self._feature(feats, cfg.instruction, label)
            out["text"] = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in raw]
            if len(out["text"]) != len(out["action"]):
                raise DatasetError(
                    f"{label}: {len(out['text'])} instructions for {len(out['action'])} steps"
                )
        return out

    def open_episode(self, episode: int) -> OpenEpisode:
        ref = self.episodes[episode]
        shard_index, offset, record = ref.where
        feats = parse_example(read_record(self.shards[shard_index], offset, record), ref.label)
        arrays = self.episode_arrays(feats, ref.label)
        actions, states, front = self.prepare(arrays["action"], arrays["state"], ref.label)
        images = {}
        for key in {self.config.primary, self.config.wrist} - {None}:
            images[key] = self._feature(feats, key, ref.label)
        return _RLDSEpisode(self, ref, actions, states, arrays["text"], front, images)


def _as_keys(value) -> tuple[str, ...]:
    if value is None:
        return ("",)
    return (value,) if isinstance(value, str) else tuple(value)


class _RLDSEpisode(OpenEpisode):
    def __init__(self, source, ref, actions, states, text, front, images):
        super().__init__(source, ref, actions, states, text, front)
        self.images = images  # key -> list of encoded frames

    def raw_image(self, raw_step: int, key: str) -> np.ndarray:
        return decode_image(self.images[key][raw_step], f"{self.ref.label}: step {raw_step}", key)


def decode_image(data: bytes, where: str, key: str) -> np.ndarray:
    """Encoded JPEG / PNG bytes -> (H, W, 3) uint8 RGB, or a DatasetError naming the frame."""
    image_mod = require("PIL.Image", "rlds", "decoding JPEG / PNG frames")
    try:
        with image_mod.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))
    except Exception as err:  # PIL raises several types for bad data
        raise DatasetError(f"{where}: image {key!r} does not decode ({err})") from None

"""LeRobot datasets, format v2.0 / v2.1 and v3.0, read with pyarrow and PyAV.

Both keep ``meta/info.json`` (``codebase_version``, ``fps``, ``features``: each with a
``dtype`` (``video``, ``image``, ``float32``...) and ``shape``, and the ``data_path`` /
``video_path`` templates) and ``meta/stats.json``. Frames are parquet rows with a column per
feature plus ``timestamp``, ``frame_index``, ``episode_index``, ``index`` and ``task_index``.

* v2.x: one parquet per episode, ``data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}
  .parquet``, and one MP4 per camera and episode, ``videos/chunk-{episode_chunk:03d}/
  {video_key}/episode_{episode_index:06d}.mp4`` (``episode_chunk = episode_index //
  chunks_size``); ``meta/episodes.jsonl`` lists the episodes (``episode_index``, ``tasks``,
  ``length``), ``meta/tasks.jsonl`` the tasks (``task_index``, ``task``).
* v3.0: many episodes per file, ``data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet``
  and ``videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4``;
  ``meta/episodes/chunk-*/file-*.parquet`` holds a row per episode with ``length``,
  ``data/chunk_index``, ``data/file_index`` and, per camera, ``videos/<key>/chunk_index``,
  ``videos/<key>/file_index`` and ``videos/<key>/from_timestamp`` (where the episode starts in
  its video file); ``meta/tasks.parquet`` maps ``task_index`` to the task (its index column).

A frame's image is the video frame at ``from_timestamp + timestamp`` (v2: ``from_timestamp``
is 0), or for ``image`` features the PNG/JPEG bytes stored in the parquet row. The instruction
is the frame's task.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from parallax.data.extras import require
from parallax.data.keys import KeyConfig, resolve_config
from parallax.data.rlds import decode_image
from parallax.data.source import OpenEpisode, Source
from parallax.data.stats import DatasetError
from parallax.data.video import VideoReader

VERSIONS = ("v2.0", "v2.1", "v3.0")
CAMERA_DTYPES = ("video", "image")


def _pq():
    return require("pyarrow.parquet", "lerobot", "reading LeRobot parquet files")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DatasetError(f"{path}: cannot be read as JSON ({err})") from None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"{path} does not exist (a LeRobot v2 dataset lists it)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _table(path: Path, columns: list[str] | None = None, filters=None):
    if not path.is_file():
        raise DatasetError(f"{path} does not exist")
    try:
        return _pq().read_table(path, columns=columns, filters=filters)
    except Exception as err:  # pyarrow raises ArrowInvalid, KeyError...
        raise DatasetError(f"{path}: cannot read columns {columns} ({err})") from None


class LeRobotSource(Source):
    """A LeRobot dataset directory (the one holding ``meta/info.json``)."""

    format = "lerobot"

    def __init__(
        self,
        path: str | Path,
        *,
        config: KeyConfig | None = None,
        user_configs: dict[str, KeyConfig] | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        root = Path(path)
        if not (root / "meta" / "info.json").is_file():
            raise DatasetError(f"{root}: no meta/info.json; is it a LeRobot dataset directory?")
        self.info = _json(root / "meta" / "info.json")
        self.version = str(self.info.get("codebase_version", "?"))
        if self.version not in VERSIONS:
            raise DatasetError(
                f"{root / 'meta' / 'info.json'}: LeRobot codebase_version {self.version!r} is "
                f"not supported (this reader knows {', '.join(VERSIONS)}); convert it with "
                "LeRobot's dataset conversion scripts"
            )
        features = self.info.get("features", {})
        cfg, is_default = resolve_config("lerobot", root.name, user_configs, config)
        cameras = [k for k, f in features.items() if f.get("dtype") in CAMERA_DTYPES]
        if cfg.primary is None:
            if not cameras:
                raise DatasetError(f"{root}: meta/info.json declares no video or image feature")
            cfg = cfg.replace(primary=cameras[0])
        if is_default:
            cfg = cfg.replace(state=tuple(k for k in cfg.state if k in features))
        for key in (*cfg.action, *cfg.state, cfg.primary, cfg.wrist, *cfg.extra):
            if key is not None and key not in features:
                raise DatasetError(
                    f"{root / 'meta' / 'info.json'}: missing key {key!r}; features are "
                    f"{sorted(features)}"
                )
        super().__init__(root, root.name, cfg)
        self.fps = float(self.info.get("fps", 0)) or None
        self.features = features
        shape = list(features[cfg.primary].get("shape", []))
        names = features[cfg.primary].get("names") or []
        if len(shape) == 3 and names and str(names[0]).startswith("channel"):
            shape = shape[1:] + shape[:1]
        self.image_shape = tuple(shape) or None
        self.tasks = self._tasks()
        files = [p for p in sorted(root.glob("meta/**/*")) if p.is_file()]
        files += sorted(root.glob("data/**/*.parquet")) + sorted(root.glob("videos/**/*.mp4"))
        self.scan(files, cache_dir)
        self._check_stats()

    # --- metadata ---------------------------------------------------------------------------
    def _tasks(self) -> dict[int, str]:
        meta = self.path / "meta"
        if self.version.startswith("v2"):
            return {int(t["task_index"]): str(t["task"]) for t in _jsonl(meta / "tasks.jsonl")}
        table = _table(meta / "tasks.parquet").to_pydict()
        text = table.get("task") or table.get("__index_level_0__")
        if text is None or "task_index" not in table:
            raise DatasetError(f"{meta / 'tasks.parquet'}: needs task_index and task columns")
        return {int(i): str(t) for i, t in zip(table["task_index"], text)}

    def _episode_rows(self) -> list[dict[str, Any]]:
        meta = self.path / "meta"
        if self.version.startswith("v2"):
            return sorted(_jsonl(meta / "episodes.jsonl"), key=lambda e: int(e["episode_index"]))
        files = sorted((meta / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetError(f"dataset {self.path} is empty: no meta/episodes/*/*.parquet")
        rows = [row for f in files for row in _table(f).to_pylist()]
        return sorted(rows, key=lambda e: int(e["episode_index"]))

    def _files(self, row: dict[str, Any]) -> tuple[str, dict[str, tuple[str, float]]]:
        """The episode's parquet file, and per camera its video file and start time."""
        ep, info = int(row["episode_index"]), self.info
        if self.version.startswith("v2"):
            chunk = ep // int(info.get("chunks_size", 1000))
            data = info["data_path"].format(episode_chunk=chunk, episode_index=ep)
            video = lambda key: (  # noqa: E731
                info["video_path"].format(episode_chunk=chunk, video_key=key, episode_index=ep),
                0.0,
            )
        else:
            data = info["data_path"].format(
                chunk_index=int(row["data/chunk_index"]), file_index=int(row["data/file_index"])
            )
            video = lambda key: (  # noqa: E731
                info["video_path"].format(
                    video_key=key,
                    chunk_index=int(row[f"videos/{key}/chunk_index"]),
                    file_index=int(row[f"videos/{key}/file_index"]),
                ),
                float(row[f"videos/{key}/from_timestamp"]),
            )
        cams = {self.config.primary, self.config.wrist, *self.config.extra} - {None}
        videos = {k: video(k) for k in cams if self.features[k].get("dtype") == "video"}
        return data, videos

    # --- scan -------------------------------------------------------------------------------
    def columns(self) -> list[str]:
        return [*self.config.action, *self.config.state, "timestamp", "task_index"]

    def frame_arrays(self, table, label: str) -> dict[str, Any]:
        """Raw actions, states, timestamps and instructions of an episode's parquet rows."""
        out: dict[str, Any] = {}
        for what, keys in (("action", self.config.action), ("state", self.config.state)):
            parts = []
            for key in keys:
                values = table.column(key).to_pylist()
                try:
                    parts.append(np.asarray(values, dtype=np.float32).reshape(len(values), -1))
                except ValueError:
                    raise DatasetError(f"{label}: {key!r} rows differ in length") from None
            out[what] = np.concatenate(parts, axis=1) if parts else None
        out["timestamp"] = np.asarray(table.column("timestamp").to_pylist(), dtype=np.float64)
        task_index = table.column("task_index").to_pylist()
        unknown = sorted(set(task_index) - set(self.tasks))
        if unknown:
            raise DatasetError(f"{label}: task_index {unknown[:5]} not in the dataset's tasks")
        out["text"] = [self.tasks[int(i)] for i in task_index]
        return out

    def scan_episodes(self) -> None:
        cache: dict[str, Any] = {}
        for row in self._episode_rows():
            ep = int(row["episode_index"])
            data, videos = self._files(row)
            label = f"{self.path / data}: episode {ep}"
            if data not in cache:  # v3: one read per file; v2: one per episode
                cache = {data: _table(self.path / data, [*self.columns(), "episode_index"])}
            table = cache[data]
            rows = np.flatnonzero(np.asarray(table.column("episode_index").to_pylist()) == ep)
            if len(rows) == 0 or rows[-1] - rows[0] + 1 != len(rows):
                raise DatasetError(f"{label}: its frames are missing or not contiguous")
            for key, (video, _) in videos.items():
                if not (self.path / video).is_file():
                    raise DatasetError(f"{label}: camera {key!r} video {video} does not exist")
            arrays = self.frame_arrays(table.slice(int(rows[0]), len(rows)), label)
            where = (data, ep, videos)
            self.add_episode(where, arrays["action"], arrays["state"], arrays["text"][0], label)

    def _check_stats(self) -> None:
        stats_path = self.path / "meta" / "stats.json"
        self.lerobot_stats = _json(stats_path) if stats_path.is_file() else {}
        declared = len(self.lerobot_stats.get(self.config.action[0], {}).get("mean", []))
        if len(self.config.action) == 1 and declared and declared != self.action_dim:
            raise DatasetError(
                f"{stats_path}: {self.config.action[0]!r} statistics have {declared} dims, the "
                f"data {self.action_dim}"
            )

    def open_episode(self, episode: int) -> OpenEpisode:
        return _LeRobotEpisode(self, episode)


class _LeRobotEpisode(OpenEpisode):
    def __init__(self, source: LeRobotSource, episode: int) -> None:
        ref = source.episodes[episode]
        data, ep, self.videos = ref.where
        columns = source.columns()
        images = [
            k for k in (source.config.primary, source.config.wrist, *source.config.extra) if k
        ]
        images = [k for k in images if source.features[k].get("dtype") == "image"]
        table = _table(source.path / data, columns + images, filters=[("episode_index", "=", ep)])
        arrays = source.frame_arrays(table, ref.label)
        actions, states, front = source.prepare(arrays["action"], arrays["state"], ref.label)
        super().__init__(source, ref, actions, states, arrays["text"], front)
        self.timestamps = arrays["timestamp"]
        self.encoded = {k: table.column(k).to_pylist() for k in images}
        self.readers: dict[str, VideoReader] = {}
        self.tolerance = 0.4 / source.fps if source.fps else 1e-3

    def raw_image(self, raw_step: int, key: str) -> np.ndarray:
        where = f"{self.ref.label}: step {raw_step}"
        if key in self.encoded:
            value = self.encoded[key][raw_step]
            data = value.get("bytes") if isinstance(value, dict) else value
            return decode_image(data or b"", where, key)
        if key not in self.readers:
            video, _ = self.videos[key]
            self.readers[key] = VideoReader(self.source.path / video)
        start = self.videos[key][1]
        try:
            return self.readers[key].frame_at(start + self.timestamps[raw_step], self.tolerance)
        except DatasetError as err:
            raise DatasetError(f"{where}: camera {key!r}: {err}") from None

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()

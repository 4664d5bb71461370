"""Tiny LeRobot datasets (v2.1 and v3.0 layouts) written with pyarrow and PyAV's encoders, a
code path apart from parallax's readers (see benchmarks/data/writers.py)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.data.writers import Ep, encode_image


@contextlib.contextmanager
def kept_scheduling() -> Iterator[None]:
    """SVT-AV1's encoder, started by root, moves the calling thread to real-time scheduling
    (SCHED_FIFO 99), which every thread and process started from it afterwards inherits: a rank
    spinning on a collective at that priority starves the rest of the machine. The caller's
    policy is put back when the encoder is done."""
    if not hasattr(os, "sched_getscheduler"):  # not Linux
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def encode_video(
    path: Path, frames: np.ndarray, fps: int, codec: str = "libx264", lossy: bool = False
) -> None:
    """Frames -> MP4. By default libx264 at crf 0 in yuv444p (lossless apart from RGB <-> YUV);
    ``lossy``: as LeRobot encodes (yuv420p, crf 30, a keyframe every 2 frames)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with kept_scheduling(), av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        if codec == "libx264" and not lossy:
            stream.pix_fmt, stream.options = "yuv444p", {"crf": "0", "g": "4"}
        else:
            stream.pix_fmt, stream.options = "yuv420p", {"crf": "30", "g": "2"}
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _features(ep: Ep, cameras: list[str], dtype: str) -> dict:
    h, w = ep.images.shape[1:3]
    feats = {
        cam: {"dtype": dtype, "shape": [h, w, 3], "names": ["height", "width", "channel"]}
        for cam in cameras
    }
    feats["observation.state"] = {"dtype": "float32", "shape": [ep.states.shape[1]], "names": None}
    feats["action"] = {"dtype": "float32", "shape": [ep.actions.shape[1]], "names": None}
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        feats[key] = {
            "dtype": "int64" if key != "timestamp" else "float32",
            "shape": [1],
            "names": None,
        }
    return feats


def _frames_table(ep: Ep, ep_index: int, first_index: int, task_index: int, fps: int, images: dict):
    import pyarrow as pa

    t = len(ep.actions)
    columns = {
        "action": pa.array([list(map(float, a)) for a in ep.actions], pa.list_(pa.float32())),
        "observation.state": pa.array(
            [list(map(float, s)) for s in ep.states], pa.list_(pa.float32())
        ),
        "timestamp": pa.array(np.arange(t, dtype=np.float32) / fps),
        "frame_index": pa.array(np.arange(t)),
        "episode_index": pa.array(np.full(t, ep_index)),
        "index": pa.array(np.arange(first_index, first_index + t)),
        "task_index": pa.array(np.full(t, task_index)),
    }
    for cam, frames in images.items():  # "image" features: PNG bytes in the row
        columns[cam] = pa.array(
            [{"bytes": encode_image(f, "png"), "path": None} for f in frames],
            pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        )
    return pa.table(columns)


def write_lerobot(
    root: Path,
    episodes: list[Ep],
    version: str = "v2.1",
    fps: int = 10,
    camera_dtype: str = "video",
    per_file: int = 2,
    codec: str = "libx264",
    lossy: bool = False,
) -> Path:
    """A LeRobot dataset (v2.1: a file per episode; v3.0: ``per_file`` episodes per file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    (root / "meta").mkdir(parents=True)
    cams = ["observation.images.top", "observation.images.wrist"]
    tasks = sorted({ep.instruction for ep in episodes})
    task_of = {t: i for i, t in enumerate(tasks)}
    v2 = version.startswith("v2")
    info = {
        "codebase_version": version,
        "robot_type": "test",
        "total_episodes": len(episodes),
        "total_frames": int(sum(len(e.actions) for e in episodes)),
        "total_tasks": len(tasks),
        "chunks_size": 1000,
        "fps": fps,
        "features": _features(episodes[0], cams, camera_dtype),
    }
    if v2:
        info["data_path"] = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
        info["video_path"] = (
            "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
        )
    else:
        info["data_path"] = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
        info["video_path"] = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    images = lambda ep: {c: f for c, f in zip(cams, (ep.images, ep.wrist))}  # noqa: E731
    index, rows = 0, []
    groups = [
        list(range(i, min(i + per_file, len(episodes)))) for i in range(0, len(episodes), per_file)
    ]
    for file_index, group in enumerate([[i] for i in range(len(episodes))] if v2 else groups):
        tables, videos, start_s = [], {c: [] for c in cams}, 0.0
        for k in group:
            ep = episodes[k]
            embedded = images(ep) if camera_dtype == "image" else {}
            tables.append(_frames_table(ep, k, index, task_of[ep.instruction], fps, embedded))
            row = {"episode_index": k, "tasks": [ep.instruction], "length": len(ep.actions)}
            row.update({"data/chunk_index": 0, "data/file_index": file_index})
            row.update({"dataset_from_index": index, "dataset_to_index": index + len(ep.actions)})
            for cam, frames in images(ep).items():
                videos[cam].append(frames)
                row.update({f"videos/{cam}/chunk_index": 0, f"videos/{cam}/file_index": file_index})
                row[f"videos/{cam}/from_timestamp"] = start_s
                row[f"videos/{cam}/to_timestamp"] = start_s + len(ep.actions) / fps
            start_s += len(ep.actions) / fps
            index += len(ep.actions)
            rows.append(row)
        fmt = {
            "episode_chunk": 0,
            "episode_index": group[0],
            "chunk_index": 0,
            "file_index": file_index,
        }
        data_path = root / info["data_path"].format(**fmt)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(tables), data_path)
        if camera_dtype == "video":
            for cam in cams:
                path = root / info["video_path"].format(video_key=cam, **fmt)
                encode_video(path, np.concatenate(videos[cam]), fps, codec, lossy)
    if v2:
        lines = [json.dumps({"task_index": i, "task": t}) for i, t in enumerate(tasks)]
        (root / "meta" / "tasks.jsonl").write_text("\n".join(lines) + "\n")
        lines = [json.dumps({k: r[k] for k in ("episode_index", "tasks", "length")}) for r in rows]
        (root / "meta" / "episodes.jsonl").write_text("\n".join(lines) + "\n")
    else:
        tasks_table = pa.table({"task_index": pa.array(range(len(tasks))), "task": pa.array(tasks)})
        pq.write_table(tasks_table, root / "meta" / "tasks.parquet")
        (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
        pq.write_table(
            pa.Table.from_pylist(rows),
            root / "meta" / "episodes" / "chunk-000" / "file-000.parquet",
        )
    actions = np.concatenate([e.actions for e in episodes])
    stats = {"action": {"mean": actions.mean(0).tolist(), "std": actions.std(0).tolist()}}
    (root / "meta" / "stats.json").write_text(json.dumps(stats))
    return root

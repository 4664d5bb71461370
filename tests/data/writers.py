"""Tiny robot datasets in RLDS, LIBERO HDF5 and LeRobot layouts, written on a code path of
their own: protobuf wire format encoded by hand (no parallax, no TensorFlow) and framed with
masked CRC-32C here; h5py, pyarrow and PyAV (FFmpeg's encoders) for the others. The readers
under test share none of this code. The benchmark uses them too.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Ep:
    """One episode to write."""

    images: np.ndarray  # (T, H, W, 3) uint8
    actions: np.ndarray  # (T, D) float32
    instruction: str
    wrist: np.ndarray | None = None  # (T, H, W, 3) uint8
    states: np.ndarray | None = None  # (T, S) float32
    extra: dict = field(default_factory=dict)


def smooth_images(rng, t, size):
    """(t, size, size, 3) uint8 frames of smooth random colour fields (what lossy codecs keep
    well; random noise would measure the codec, not the reader)."""
    coarse = rng.uniform(0, 255, (t, 4, 4, 3))
    pos = np.linspace(0, 3, size)
    i0 = np.minimum(pos.astype(int), 2)
    f = (pos - i0)[None, :, None, None]
    rows = coarse[:, i0] * (1 - f) + coarse[:, i0 + 1] * f  # (t, size, 4, 3)
    g = (pos - i0)[None, None, :, None]
    full = rows[:, :, i0] * (1 - g) + rows[:, :, i0 + 1] * g
    return full.round().astype(np.uint8)


def make_episodes(n, length=5, size=16, action_dim=7, state_dim=8, seed=0, lengths=None):
    """``n`` episodes of random images, actions and states (lengths vary unless given)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        t = int(lengths[k]) if lengths is not None else int(length + k % 3)
        out.append(
            Ep(
                images=smooth_images(rng, t, size),
                wrist=smooth_images(rng, t, size),
                actions=rng.normal(size=(t, action_dim)).astype(np.float32),
                states=rng.normal(size=(t, state_dim)).astype(np.float32),
                instruction=f"task number {k % 4}",
            )
        )
    return out


# --- protobuf wire format and TFRecord framing -------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negatives as 64-bit two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def feature_bytes(values: list[bytes]) -> bytes:
    return _len_field(1, b"".join(_len_field(1, v) for v in values))


def feature_floats(values) -> bytes:
    packed = struct.pack(f"<{len(values)}f", *np.asarray(values, np.float32).ravel())
    return _len_field(2, _len_field(1, packed))


def feature_ints(values) -> bytes:
    return _len_field(3, _len_field(1, b"".join(_varint(int(v)) for v in values)))


def example(features: dict[str, bytes]) -> bytes:
    """A serialized tf.train.Example from already-encoded Feature messages."""
    entries = b"".join(
        _len_field(1, _len_field(1, key.encode()) + _len_field(2, feat))
        for key, feat in features.items()
    )
    return _len_field(1, entries)


def crc32c_masked(data: bytes) -> int:
    import crc32c

    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", crc32c_masked(length))
        + data
        + struct.pack("<I", crc32c_masked(data))
    )


def encode_image(image: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(
        buf, format=fmt.upper(), **({"quality": 95, "subsampling": 0} if fmt == "jpeg" else {})
    )
    return buf.getvalue()


def _tensor(shape, dtype="float32"):
    return {
        "pythonClassName": "tensorflow_datasets.core.features.tensor_feature.Tensor",
        "tensor": {
            "shape": {"dimensions": [str(d) for d in shape]},
            "dtype": dtype,
            "encoding": "none",
        },
    }


def _image(shape, fmt):
    return {
        "pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
        "image": {
            "shape": {"dimensions": [str(d) for d in shape]},
            "dtype": "uint8",
            "encodingFormat": fmt,
        },
    }


def _dict(features):
    return {
        "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
        "featuresDict": {"features": features},
    }


def write_rlds(
    root: Path, name: str, episodes: list[Ep], fmt: str = "png", shards: int = 2
) -> Path:
    """``root/name/1.0.0/`` with features.json, dataset_info.json and ``shards`` shards."""
    out = Path(root) / name / "1.0.0"
    out.mkdir(parents=True)
    first = episodes[0]
    shape = list(first.images.shape[1:])
    steps = {
        "action": _tensor([first.actions.shape[1]]),
        "observation": _dict(
            {
                "image": _image(shape, fmt),
                "wrist_image": _image(shape, fmt),
                "state": _tensor([first.states.shape[1]]),
            }
        ),
        "language_instruction": {
            "pythonClassName": "tensorflow_datasets.core.features.text_feature.Text",
            "text": {},
        },
        **{k: _tensor([], "bool") for k in ("is_first", "is_last", "is_terminal")},
        "reward": _tensor([]),
    }
    features = _dict(
        {
            "steps": {
                "pythonClassName": "tensorflow_datasets.core.features.dataset_feature.Dataset",
                "sequence": {"feature": _dict(steps), "length": "-1"},
            },
            "episode_metadata": _dict({"file_path": {"pythonClassName": "x.Text", "text": {}}}),
        }
    )
    (out / "features.json").write_text(json.dumps(features))
    per_shard = np.array_split(np.arange(len(episodes)), shards)
    for s, ids in enumerate(per_shard):
        blob = b"".join(frame(rlds_record(episodes[i], fmt)) for i in ids)
        (out / f"{name}-train.tfrecord-{s:05d}-of-{shards:05d}").write_bytes(blob)
    info = {
        "name": name,
        "version": "1.0.0",
        "fileFormat": "tfrecord",
        "splits": [{"name": "train", "shardLengths": [str(len(ids)) for ids in per_shard]}],
    }
    (out / "dataset_info.json").write_text(json.dumps(info))
    return out


def rlds_record(ep: Ep, fmt: str = "png") -> bytes:
    t = len(ep.actions)
    flags = {
        "is_first": [1] + [0] * (t - 1),
        "is_last": [0] * (t - 1) + [1],
        "is_terminal": [0] * (t - 1) + [1],
    }
    feats = {
        "steps/action": feature_floats(ep.actions.ravel()),
        "steps/observation/image": feature_bytes([encode_image(i, fmt) for i in ep.images]),
        "steps/observation/wrist_image": feature_bytes([encode_image(i, fmt) for i in ep.wrist]),
        "steps/observation/state": feature_floats(ep.states.ravel()),
        "steps/language_instruction": feature_bytes([ep.instruction.encode()] * t),
        "steps/reward": feature_floats(np.zeros(t)),
        **{f"steps/{k}": feature_ints(v) for k, v in flags.items()},
        "episode_metadata/file_path": feature_bytes([b"/x/y.npy"]),
        **ep.extra,  # replaces features; None drops one
    }
    return example({k: v for k, v in feats.items() if v is not None})


# --- LIBERO HDF5 --------------------------------------------------------------------------------


def write_libero(folder: Path, tasks: dict[str, list[Ep]], problem_info: bool = True) -> Path:
    """One ``<task>_demo.hdf5`` per task; the stored frames are the given ones turned upside
    down (as LIBERO's simulator renders them)."""
    import h5py

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for task, episodes in tasks.items():
        with h5py.File(folder / f"{task}_demo.hdf5", "w") as f:
            data = f.create_group("data")
            if problem_info:
                data.attrs["problem_info"] = json.dumps(
                    {"problem_name": "x", "language_instruction": episodes[0].instruction}
                )
            for i, ep in enumerate(episodes):
                demo = data.create_group(f"demo_{i}")
                obs = demo.create_group("obs")
                obs.create_dataset("agentview_rgb", data=ep.images[:, ::-1, ::-1])
                obs.create_dataset("eye_in_hand_rgb", data=ep.wrist[:, ::-1, ::-1])
                obs.create_dataset("ee_states", data=ep.states[:, :6].astype(np.float64))
                obs.create_dataset("gripper_states", data=ep.states[:, 6:8].astype(np.float64))
                obs.create_dataset("joint_states", data=np.zeros((len(ep.actions), 7)))
                demo.create_dataset("actions", data=ep.actions.astype(np.float64))
                demo.attrs["num_samples"] = len(ep.actions)
    return folder


# --- LeRobot ------------------------------------------------------------------------------------


def encode_video(
    path: Path, frames: np.ndarray, fps: int, codec: str = "libx264", lossy: bool = False
) -> None:
    """Frames -> MP4. By default libx264 at crf 0 in yuv444p (lossless apart from RGB <-> YUV);
    ``lossy``: as LeRobot encodes (yuv420p, crf 30, a keyframe every 2 frames)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
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

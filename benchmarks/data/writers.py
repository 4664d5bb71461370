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

"""Image-text pairs: the sample type, image decoding, and a folder with a captions file.

A pair source is a list of *shards* with random access inside each (a folder is one shard, a
WebDataset tar file is one shard): the loader (:mod:`parallax.data.pair_loader`) shuffles shards
and the samples of a few shards at a time, and reads only the samples of its own rank. A raw
sample is ``{"image": (H, W, 3) uint8 numpy array, "caption": str, "key": str}``; the model side
tokenises and preprocesses it (:func:`parallax.families.siglip.inputs.pair_batch`).

Folder layout::

    my_pairs/
      captions.jsonl     one {"image": "relative/path.jpg", "caption": "...", "key": "..."} a line
                         ("key" optional; "file_name" and "text" are accepted aliases)
      (or captions.csv   with a header row naming the columns image,caption[,key])
      images/...         JPEG/PNG/WebP (decoded with Pillow, an optional extra) or .npy arrays

Images may be any size and RGB, grey or RGBA (converted to RGB); preprocessing resizes them.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from parallax.data.stats import DatasetError

PairSample = dict[str, Any]
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "npy")
_IMAGE_KEYS, _CAPTION_KEYS = ("image", "file_name", "path"), ("caption", "text")


class PairSource(Protocol):
    """What the pair loader needs."""

    name: str

    def num_shards(self) -> int: ...

    def shard_length(self, shard: int) -> int: ...

    def read(self, shard: int, index: int) -> PairSample: ...


def decode_image(data: bytes, ext: str, what: str) -> np.ndarray:
    """Encoded image bytes -> ``(H, W, 3)`` uint8. ``.npy`` needs only numpy; the rest Pillow."""
    if ext == "npy":
        arr = np.load(io.BytesIO(data), allow_pickle=False)
        return _as_rgb(arr, what)
    try:
        from PIL import Image  # optional dependency (pillow)
    except ImportError as err:
        raise ImportError(
            f"decoding {what} needs the optional Pillow package (pip install -e '.[images]')"
        ) from err
    try:
        with Image.open(io.BytesIO(data)) as img:
            return np.array(img.convert("RGB"))  # writable: torch warns on a read-only array
    except Exception as err:  # Pillow raises several error types for bad files
        raise DatasetError(f"cannot decode image {what}: {err}") from err


def _as_rgb(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4) or arr.dtype != np.uint8 or 0 in arr.shape:
        raise DatasetError(
            f"image {what} must be a non-empty (H, W, 3) uint8 array, got {arr.dtype} "
            f"{tuple(arr.shape)}"
        )
    return np.ascontiguousarray(arr[:, :, :3])


def _pick(row: dict, keys: tuple[str, ...], what: str, where: str) -> str:
    for k in keys:
        if row.get(k) not in (None, ""):
            return str(row[k])
    raise DatasetError(f"{where}: no {what} (one of the keys {list(keys)})")


def _read_rows(file: Path) -> list[dict]:
    if file.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{file}:{n}: not a JSON object: {err}") from err
        return rows
    with file.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


class PairFolder:
    """Pairs listed in ``captions.jsonl`` (or ``.csv``) under ``root``; one shard."""

    def __init__(self, root: str | Path, captions: str | None = None) -> None:
        self.root = Path(root)
        names = [captions] if captions else ["captions.jsonl", "captions.csv"]
        files = [self.root / n for n in names if (self.root / n).is_file()]
        if not files:
            raise DatasetError(f"no {' or '.join(names)} in pair folder {self.root}")
        self.name = self.root.name
        self.entries: list[tuple[str, str, str]] = []
        for n, row in enumerate(_read_rows(files[0]), 1):
            where = f"{files[0].name} row {n}"
            image = _pick(row, _IMAGE_KEYS, "image path", where)
            caption = _pick(row, _CAPTION_KEYS, "caption", where)
            self.entries.append((image, caption, str(row.get("key") or Path(image).stem)))
        if not self.entries:
            raise DatasetError(f"pair folder {self.root} lists no pairs in {files[0].name}")

    def num_shards(self) -> int:
        return 1

    def shard_length(self, shard: int) -> int:
        return len(self.entries)

    def read(self, shard: int, index: int) -> PairSample:
        image, caption, key = self.entries[index]
        file = self.root / image
        if not file.is_file():
            raise DatasetError(f"pair {key!r}: image file {file} is missing")
        ext = file.suffix.lower().lstrip(".")
        return {
            "image": decode_image(file.read_bytes(), ext, str(file)),
            "caption": caption,
            "key": key,
        }


def write_pair_folder(root: str | Path, pairs: list[PairSample], fmt: str = "jsonl") -> Path:
    """Write pairs as a folder (images as .npy, no Pillow needed): for tests and conversions."""
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, p in enumerate(pairs):
        key = p.get("key") or f"{i:09d}"
        np.save(root / "images" / f"{key}.npy", np.asarray(p["image"], dtype=np.uint8))
        rows.append({"image": f"images/{key}.npy", "caption": p["caption"], "key": key})
    if fmt == "jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (root / "captions.jsonl").write_text(text, encoding="utf-8")
    else:
        with (root / "captions.csv").open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=["image", "caption", "key"])
            w.writeheader()
            w.writerows(rows)
    return root

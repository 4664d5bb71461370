"""The LLaVA conversation format: a JSON (or JSONL) list of samples with an image folder.

Each sample is ``{"id": ..., "image": "relative/path.jpg" (optional), "conversations": [{"from":
"human", "value": "<image>\\nWhat is ...?"}, {"from": "gpt", "value": "..."}, ...]}``: turns
alternate, the human first and an answer last, and ``<image>`` appears exactly once (in a human
turn) when the sample has an image and never otherwise. Every sample is checked when the dataset
is opened (no image is decoded for that), so bad data fails before training with a message
naming the sample. Items are raw samples ``{"id", "image": (H, W, 3) uint8 tensor or None,
"conversations"}``; the model side (:class:`parallax.models.LlavaNextProcessor`) tokenises them.
Images are read with Pillow, an optional package imported when the first image is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parallax.data.stats import DatasetError

IMAGE_TAG = "<image>"
ROLES = ("human", "gpt")


def conversation_turns(
    conversations: Any, *, has_image: bool, sample_id: Any
) -> list[tuple[str, str]]:
    """The (question, answer) rounds of one sample's ``conversations``, with the ``<image>`` tag
    moved to the start of its turn as LLaVA does (``"<image>\\n" + rest``); a
    :class:`DatasetError` naming the sample for anything else."""
    where = f"sample {sample_id!r}"
    if not isinstance(conversations, list) or not conversations:
        raise DatasetError(f"{where}: 'conversations' must be a non-empty list of turns")
    values = []
    for k, turn in enumerate(conversations):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise DatasetError(
                f"{where}: turn {k} must be {{'from': ..., 'value': str}}, got {turn!r}"
            )
        if turn.get("from") != ROLES[k % 2]:
            raise DatasetError(
                f"{where}: turn {k} is from {turn.get('from')!r}, expected {ROLES[k % 2]!r} (turns "
                "alternate human, gpt, starting with the human)"
            )
        values.append(turn["value"])
    if len(values) % 2:
        raise DatasetError(f"{where}: the last question (turn {len(values) - 1}) has no answer")
    tags = [v.count(IMAGE_TAG) for v in values]
    if sum(tags[1::2]):
        raise DatasetError(f"{where}: an answer contains the {IMAGE_TAG} tag")
    if has_image and sum(tags) != 1:
        what = "no" if sum(tags) == 0 else f"{sum(tags)}"
        raise DatasetError(f"{where}: has an image but {what} {IMAGE_TAG} tags (needs exactly one)")
    if not has_image and sum(tags):
        raise DatasetError(f"{where}: has a {IMAGE_TAG} tag but no image")
    turns = []
    for q, a in zip(values[0::2], values[1::2]):
        if not a.strip():
            raise DatasetError(f"{where}: an empty answer to {q[:40]!r}")
        if IMAGE_TAG in q:
            q = IMAGE_TAG + "\n" + q.replace(IMAGE_TAG, "").strip()
        turns.append((q, a))
    return turns


def read_records(path: str | Path) -> list[dict]:
    """The samples of a ``.json`` list or a ``.jsonl`` file (one sample per line)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"no LLaVA conversation file at {path}")
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise DatasetError(f"{path}: expected a list of samples (objects)")
    return records


def _pillow():
    try:  # Pillow: an optional dependency
        from PIL import Image
    except ImportError as err:
        raise ImportError(
            "reading image files needs the optional 'pillow' package (pip install pillow)"
        ) from err
    return Image


def read_image(path: Path, sample_id: Any = None) -> torch.Tensor:
    """An image file as ``(H, W, 3)`` uint8 (Pillow, optional); a file Pillow cannot decode
    (not an image, truncated) is a :class:`DatasetError` naming the file and the sample."""
    image = _pillow()
    try:
        with image.open(path) as im:
            return torch.from_numpy(np.array(im.convert("RGB")))  # a writable copy
    except Exception as err:  # Pillow raises several error types for bad files
        raise DatasetError(_bad_image(path, sample_id, err)) from None


def image_header_size(path: Path, sample_id: Any = None) -> tuple[int, int]:
    """(height, width) from an image file's header, without decoding its pixels."""
    image = _pillow()
    try:
        with image.open(path) as im:
            return im.height, im.width
    except Exception as err:
        raise DatasetError(_bad_image(path, sample_id, err)) from None


def _bad_image(path: Path, sample_id: Any, err: Exception) -> str:
    where = "" if sample_id is None else f"sample {sample_id!r}: "
    why = str(err) if str(path) not in str(err) else "not an image file Pillow can read"
    return f"{where}cannot decode image {path}: {why}"


class LlavaConversationDataset:
    """Indexable raw samples of a LLaVA conversation file (see the module doc)."""

    statistics: dict[str, Any] = {}

    def __init__(
        self, path: str | Path, image_folder: str | Path | None = None, name: str | None = None
    ) -> None:
        self.path = Path(path)
        self.image_folder = Path(image_folder) if image_folder is not None else self.path.parent
        self.name = name or self.path.stem
        self.records = read_records(self.path)
        if not self.records:
            raise DatasetError(f"{self.path} holds no samples")
        for i, r in enumerate(self.records):
            sid = r.get("id", i)
            image = r.get("image")
            if image is not None and not isinstance(image, str):
                raise DatasetError(f"sample {sid!r}: 'image' must be one file name, got {image!r}")
            conversation_turns(r.get("conversations"), has_image=image is not None, sample_id=sid)
            if image is not None and not (self.image_folder / image).is_file():
                raise DatasetError(
                    f"sample {sid!r}: image {self.image_folder / image} does not exist"
                )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        r = self.records[index]
        image = r.get("image")
        return {
            "id": r.get("id", index),
            "image": None
            if image is None
            else read_image(self.image_folder / image, r.get("id", index)),
            "conversations": r["conversations"],
        }

    def image_size(self, index: int) -> tuple[int, int] | None:
        """(height, width) of sample ``index``'s image from the file header, or ``None``."""
        r = self.records[index]
        if r.get("image") is None:
            return None
        return image_header_size(self.image_folder / r["image"], r.get("id", index))

    def meta(self, index: int) -> dict[str, Any]:
        """What a sample's token count depends on, without decoding the image."""
        r = self.records[index]
        return {
            "id": r.get("id", index),
            "image_size": self.image_size(index),
            "conversations": r["conversations"],
        }

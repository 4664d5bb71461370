"""Episodes from a folder of frames and actions (``python -m parallax.data.convert folder``).

:data:`FOLDER_LAYOUT` says the layout (it is also the command's ``--help`` epilog):
:func:`read_folder` reads it one episode at a time, checking every episode's actions, and
:func:`resize_frames` brings frames of different cameras to one shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from parallax.data.episodes import Episode
from parallax.data.stats import DatasetError, check_finite

FRAME_SUFFIXES = (".npy", ".png", ".jpg", ".jpeg")
OPENVLA_ACTION_DIM = 7
FOLDER_LAYOUT = """\
SRC holds one folder per episode (taken in sorted name order, episode_2 before episode_10):

  SRC/
    instructions.json         optional: {"<episode folder>": "<instruction>", ...}
    <episode folder>/
      instruction.txt         the instruction, e.g. "put the cup in the sink"
                              (unless instructions.json has it)
      actions.npy             (T, D) numbers, one row per step, or
      actions.csv             T rows of D comma-separated numbers (one header line allowed)
      images.npy              (T, H, W, 3) uint8 RGB, or
      images/                 T frames in name order: .npy (H, W, 3) uint8, .png or .jpg
                              (PNG and JPEG need Pillow: pip install pillow)

Step t's action is what the robot did after seeing frame t. D is --action-dim (default 7:
x, y, z, roll, pitch, yaw, gripper; the last dimension is the gripper, not normalised).

Example:

  my_episodes/
    instructions.json         {"2024-05-01_run1": "pick up the red cup"}
    2024-05-01_run1/
      actions.csv
      images/frame_000.png  frame_001.png  ...
    2024-05-01_run2/
      instruction.txt
      actions.npy
      images.npy

  python -m parallax.data.convert folder my_episodes/ data/kitchen --image-size 224
"""


def _natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _read_frame(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    try:
        from PIL import Image  # optional dependency (pillow)
    except ImportError:
        raise DatasetError(
            f"{path}: reading {path.suffix} frames needs Pillow (pip install pillow); "
            "or save the frames as .npy arrays (H, W, 3) uint8"
        ) from None
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _read_images(ep_dir: Path) -> np.ndarray:
    if (ep_dir / "images.npy").is_file():
        return np.load(ep_dir / "images.npy", allow_pickle=False)
    frames_dir = ep_dir / "images"
    frames = sorted(
        (p for p in frames_dir.glob("*") if p.suffix.lower() in FRAME_SUFFIXES), key=_natural_key
    )
    if not frames:
        raise DatasetError(
            f"{ep_dir}: no images.npy and no frames ({', '.join(FRAME_SUFFIXES)}) in images/"
        )
    return np.stack([_read_frame(p) for p in frames])


def _read_actions(ep_dir: Path) -> np.ndarray:
    if (ep_dir / "actions.npy").is_file():
        return np.load(ep_dir / "actions.npy", allow_pickle=False)
    path = ep_dir / "actions.csv"
    if not path.is_file():
        raise DatasetError(f"{ep_dir}: no actions.npy or actions.csv")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    try:
        float(lines[0].split(",")[0])
    except (ValueError, IndexError):
        lines = lines[1:]  # a header line
    try:
        rows = [[float(v) for v in ln.split(",")] for ln in lines]
    except ValueError as err:
        raise DatasetError(f"{path}: not a CSV of numbers ({err})") from None
    for k, row in enumerate(rows):
        if len(row) != len(rows[0]):
            raise DatasetError(
                f"{path}: data row {k + 1} has {len(row)} numbers, the first has {len(rows[0])}"
            )
    return np.array(rows, dtype=np.float32).reshape(len(rows), -1)


def resize_frames(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (T, h, w, 3) uint8."""
    x = images.permute(0, 3, 1, 2).float()  # (T, 3, H, W)
    x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _check_actions(ep_dir: Path, actions: np.ndarray, action_dim: int) -> None:
    file = "actions.npy" if (ep_dir / "actions.npy").is_file() else "actions.csv"
    if actions.ndim != 2:
        raise DatasetError(
            f"{ep_dir / file}: actions must be (T, D), one row per step, got {actions.shape}"
        )
    if actions.shape[1] != action_dim:
        raise DatasetError(
            f"{ep_dir / file}: {actions.shape[1]}-dimensional actions, but --action-dim is "
            f"{action_dim}{' (the default: OpenVLA)' if action_dim == OPENVLA_ACTION_DIM else ''}"
            f"; pass --action-dim {actions.shape[1]} if that is your robot's action (training "
            f"then needs a model whose statistics are {actions.shape[1]}-dimensional too, or "
            "none: a preset)"
        )
    check_finite(actions, "action", str(ep_dir / file))


def read_folder(
    src: str | Path,
    image_size: tuple[int, int] | None = None,
    action_dim: int = OPENVLA_ACTION_DIM,
) -> Iterator[Episode]:
    """Episodes of a source folder laid out as ``FOLDER_LAYOUT`` says, one at a time."""
    src = Path(src)
    if not src.is_dir():
        raise DatasetError(f"source folder {src} does not exist")
    ep_dirs = sorted((p for p in src.iterdir() if p.is_dir()), key=_natural_key)
    if not ep_dirs:
        raise DatasetError(
            f"{src} has no episode folders (python -m parallax.data.convert folder --help "
            "shows the layout)"
        )
    names: dict[str, str] = {}
    if (src / "instructions.json").is_file():
        names = json.loads((src / "instructions.json").read_text())
    for ep_dir in ep_dirs:
        if ep_dir.name in names:
            instruction = names[ep_dir.name]
        elif (ep_dir / "instruction.txt").is_file():
            instruction = (ep_dir / "instruction.txt").read_text().strip()
        else:
            raise DatasetError(f"{ep_dir}: no instruction.txt and no entry in instructions.json")
        images = np.asarray(_read_images(ep_dir))
        if images.dtype != np.uint8:
            raise DatasetError(f"{ep_dir}: images must be uint8 RGB, got {images.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(images))
        if image_size is not None and tensor.ndim == 4 and tuple(tensor.shape[1:3]) != image_size:
            tensor = resize_frames(tensor, image_size)
        actions = np.asarray(_read_actions(ep_dir), dtype=np.float32)
        _check_actions(ep_dir, actions, action_dim)
        yield Episode(tensor, torch.from_numpy(actions), instruction)

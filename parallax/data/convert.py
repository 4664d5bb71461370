"""Write a dataset in the parallax episode format (see :mod:`parallax.data.episodes`).

From a folder of episodes (``python -m parallax.data.convert folder --help`` shows the layout)::

    python -m parallax.data.convert folder SRC OUT [--name NAME] [--image-size H [W]]
                                                   [--action-dim D]

From the built-in synthetic task (to see the format, or to train from disk)::

    python -m parallax.data.convert synthetic OUT [--episodes 100] [--image-size 64] [--seed 0]

From another project's format (read in place, see :mod:`parallax.data.mixture`)::

    python -m parallax.data.convert rlds|lerobot|libero|auto SRC OUT [--name NAME]
        [--image-size H [W]] [--data-config KEYS.toml]

takes the primary camera, the dataset config's actions (gripper standardised as OpenVLA does)
and each episode's first instruction; ``auto`` detects the format.

``--image-size`` resizes every frame (bilinear, antialiased) so that episodes of different
cameras share one shape. Every episode's actions must have ``--action-dim`` numbers (7 by
default: OpenVLA's x, y, z, roll, pitch, yaw, gripper); the statistics and the index record that
dimension, and training checks it against the model's. Nothing is pickled; the output appears
only once it is complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from parallax.data.episodes import Episode, write_dataset
from parallax.data.keys import load_key_configs
from parallax.data.mixture import DataSpec, open_source
from parallax.data.stats import DatasetError, check_finite
from parallax.data.synthetic import SyntheticTask

log = logging.getLogger(__name__)
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


def _resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
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
            tensor = _resize(tensor, image_size)
        actions = np.asarray(_read_actions(ep_dir), dtype=np.float32)
        _check_actions(ep_dir, actions, action_dim)
        yield Episode(tensor, torch.from_numpy(actions), instruction)


FOREIGN = ("rlds", "lerobot", "libero", "auto")  # readers of other projects' formats


def read_source(source, image_size: tuple[int, int] | None = None) -> Iterator[Episode]:
    """The episodes of an opened :class:`~parallax.data.source.Source` (primary camera, the
    config's actions, the first step's instruction), one at a time."""
    for k in range(len(source.episodes)):
        opened = source.open_episode(k)
        try:
            length = source.episodes[k].length
            frames = np.stack([opened.image(t) for t in range(length)])
            tensor = torch.from_numpy(frames)
            if image_size is not None and tuple(tensor.shape[1:3]) != image_size:
                tensor = _resize(tensor, image_size)
            actions = torch.from_numpy(np.asarray(opened.actions, dtype=np.float32))
            yield Episode(tensor, actions, opened.instruction(0))
        finally:
            opened.close()


def _convert_foreign(args) -> Path:

    configs = load_key_configs(args.data_config) if args.data_config else None
    fmt = None if args.source == "auto" else args.source
    source = open_source(DataSpec(path=str(args.src), format=fmt), user_configs=configs)
    size = args.image_size
    if size is not None and len(size) not in (1, 2):
        raise DatasetError(f"--image-size takes H or H W, got {size}")
    size = None if size is None else (size[0], size[-1])
    name = args.name or source.name
    return write_dataset(args.out, read_source(source, size), name, args.overwrite)


def _add_foreign(sub) -> None:
    helps = {
        "rlds": "convert an RLDS / TFDS dataset (features.json + .tfrecord shards)",
        "lerobot": "convert a LeRobot v2.x / v3.0 dataset (meta/info.json)",
        "libero": "convert LIBERO HDF5 demos (a suite folder or one file)",
        "auto": "convert an RLDS, LeRobot or LIBERO dataset, its format detected",
    }
    for fmt in FOREIGN:
        p = sub.add_parser(fmt, help=helps[fmt])
        p.add_argument("src", type=Path)
        p.add_argument("out", type=Path)
        p.add_argument("--name", default=None, help="dataset name (default: the source's)")
        p.add_argument("--image-size", type=int, nargs="+", metavar="H [W]")
        p.add_argument("--data-config", type=Path, help="TOML of per-dataset key configs")
        p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parallax.data.convert",
        description="Write a dataset in the parallax episode format.",
    )
    sub = parser.add_subparsers(dest="source", required=True)
    folder = sub.add_parser(
        "folder",
        help="convert a folder of episodes (folder --help shows its layout)",
        description="Convert a folder of episodes into a parallax dataset directory.",
        epilog=FOLDER_LAYOUT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    folder.add_argument("src", type=Path, help="the folder of episodes (layout below)")
    folder.add_argument("out", type=Path, help="the dataset directory to write")
    folder.add_argument("--name", default=None, help="dataset name (default: OUT's name)")
    folder.add_argument(
        "--image-size",
        type=int,
        nargs="+",
        metavar="SIZE",
        help="H, or H W: resize every frame to H x W",
    )
    folder.add_argument(
        "--action-dim",
        type=int,
        default=OPENVLA_ACTION_DIM,
        metavar="D",
        help=f"numbers per action (default {OPENVLA_ACTION_DIM}, as OpenVLA)",
    )
    synth = sub.add_parser("synthetic", help="export the built-in synthetic task")
    synth.add_argument("out", type=Path)
    synth.add_argument("--episodes", type=int, default=100)
    synth.add_argument("--episode-length", type=int, default=5)
    synth.add_argument("--image-size", type=int, default=64)
    synth.add_argument("--camera", choices=("wrist", "static"), default="wrist")
    synth.add_argument("--seed", type=int, default=0)
    for p in (folder, synth):
        p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    _add_foreign(sub)
    return parser


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"{out} already exists and is not empty; pass --overwrite to replace it")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        _check_out(args.out, args.overwrite)
        if args.source in FOREIGN:
            out = _convert_foreign(args)
        elif args.source == "synthetic":
            task = SyntheticTask(
                seed=args.seed,
                num_episodes=args.episodes,
                episode_length=args.episode_length,
                image_size=args.image_size,
                camera=args.camera,
            )
            out = write_dataset(args.out, task.episodes(), task.name, args.overwrite)
        else:
            size = args.image_size
            if size is not None and len(size) not in (1, 2):
                raise DatasetError(f"--image-size takes H or H W, got {size}")
            if args.action_dim < 1:
                raise DatasetError(f"--action-dim must be >= 1, got {args.action_dim}")
            size = None if size is None else (size[0], size[-1])
            name = args.name or args.out.name
            episodes = read_folder(args.src, size, args.action_dim)
            out = write_dataset(args.out, episodes, name, args.overwrite)
    except (DatasetError, ValueError, OSError) as err:
        print(f"parallax.data.convert: error: {err}", file=sys.stderr)
        return 1
    index = json.loads((out / "index.json").read_text())
    print(
        f"wrote {out}: {index['num_episodes']} episodes, {index['num_transitions']} steps, "
        f"{index['action_dim']}-dimensional actions, images {index['image_shape']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from parallax.data.episodes import Episode, write_dataset
from parallax.data.folder import (
    FOLDER_LAYOUT,
    FRAME_SUFFIXES,
    OPENVLA_ACTION_DIM,
    read_folder,
    resize_frames,
)
from parallax.data.keys import load_key_configs
from parallax.data.mixture import DataSpec, open_source
from parallax.data.stats import DatasetError
from parallax.data.synthetic import SyntheticTask

log = logging.getLogger(__name__)

__all__ = [
    "FOLDER_LAYOUT",
    "FOREIGN",
    "FRAME_SUFFIXES",
    "OPENVLA_ACTION_DIM",
    "main",
    "read_folder",
    "read_source",
]

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
                tensor = resize_frames(tensor, image_size)
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

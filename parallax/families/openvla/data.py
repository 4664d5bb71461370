"""OpenVLA's data in the trainer: which ``--data`` streams, how it is opened, its loader.

Robot datasets (RLDS / Open X-Embodiment, LIBERO HDF5, LeRobot, mixtures of them, a
``[[data]]`` list) are read in place by :func:`parallax.data.load_mixture` and streamed by
:class:`parallax.data.StreamLoader`: the order of every global batch is a function of the seed
and the position only (never of dp or the worker count), images are resized to the model's
resolution and augmented as OpenVLA trains (``--augment``, on by default) in ``--workers``
processes, and the position is a small JSON state saved in checkpoints. The built-in synthetic
task and parallax's own episode directories keep the random-access
:class:`~parallax.data.BatchLoader`.

The scan of a dataset (checksums, keys, dimensions, statistics) is written to
``OUT/data_index/``; the trainer lets rank 0 scan first, and the other ranks read its index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parallax.data.keys import load_key_configs
from parallax.data.mixture import Mixture, detect_format, load_mixture, parse_data_spec
from parallax.data.stats import DatasetError
from parallax.data.stream import StreamLoader
from parallax.data.workers import auto_workers
from parallax.recipe import batch_args
from parallax.run import Run

STREAMED = ("rlds", "lerobot", "libero")


def is_streamed(data: Any) -> bool:
    """Whether ``--data`` names robot data to stream (a mixture, a ``[[data]]`` list, a
    robot format given or detected) rather than the synthetic task or a parallax directory."""
    if isinstance(data, list):
        return True
    if data == "synthetic":
        return False
    specs = parse_data_spec(data)
    if len(specs) > 1 or specs[0].weight is not None:
        return True
    (one,) = specs
    if one.format is not None:
        return one.format in STREAMED
    if not Path(one.path).exists():
        return False  # the episode reader says what is missing
    try:
        return detect_format(one.path) in STREAMED
    except DatasetError:
        return False


def index_dir(run: Run) -> Path:
    return Path(run.out) / "data_index"


def open_mixture(run: Run) -> Mixture:
    """Every dataset of ``run.data`` opened and scanned (or its scan read from the index),
    with the per-dataset key configs of ``--data-config``."""
    user = None
    if run.data_config:
        if not Path(run.data_config).is_file():
            raise DatasetError(f"--data-config {run.data_config}: no such file")
        user = load_key_configs(run.data_config)
    return load_mixture(run.data, user_configs=user, seed=run.seed, cache_dir=index_dir(run))


def stream_loader(mixture: Mixture, run: Run, ctx, image_size: int, **oft):
    """The streaming loader of one rank (see the module doc); ``oft``: OpenVLA-OFT's cameras,
    state and action chunks (:func:`~.oft.data.stream_kwargs`)."""

    augment = True if run.augment is None else run.augment
    return StreamLoader(
        mixture,
        **batch_args(run, ctx),
        images="train" if augment else "none",
        image_size=image_size,
        workers=auto_workers() if run.workers is None else run.workers,
        **oft,
    )

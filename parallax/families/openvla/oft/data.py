"""OpenVLA-OFT's data in the trainer: what the data gives (the action and state sizes, the
cameras), the synthetic task's OFT form, and the streaming loader's OFT arguments.

Nothing is chosen by a platform's name: the action dimension is the dataset's (its
statistics), the proprio token exists when the dataset's key config names state keys the data
has, and a sample has the wrist camera's image beside the primary one when its key config
names a wrist camera (``--data-config`` changes either, as for any robot dataset). Every
dataset of a mixture must agree on the three, since one model takes them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parallax.data.mixture import Mixture
from parallax.data.stats import DatasetError
from parallax.data.synthetic import SyntheticTask
from parallax.families.openvla.oft.config import OFTConfig
from parallax.families.openvla.oft.options import OFTOptions

SYNTHETIC_EXTRA_STEPS = 4  # the synthetic OFT episodes: chunk + 4 steps (5 samples each)


@dataclass(frozen=True)
class DataShape:
    """What one sample of a dataset gives an OFT model."""

    action_dim: int
    proprio_dim: int  # 0: no state
    num_images: int  # primary camera (+ wrist)


def synthetic_task(options: OFTOptions, seed: int):
    """The synthetic task's OFT form (:mod:`parallax.data.synthetic`): a static third-person
    camera, the wrist camera, the gripper's position as state, chunks of ``--action-chunk``
    actions, episodes a few steps longer than a chunk."""
    chunk = options.chunk
    return SyntheticTask(
        seed=seed,
        camera="static",
        wrist_image=True,
        state=True,
        chunk=chunk,
        episode_length=chunk + SYNTHETIC_EXTRA_STEPS,
    )


def data_shape(dataset: Any) -> DataShape:
    """The action and state sizes and the cameras of ``dataset`` (see the module doc)."""
    if isinstance(dataset, SyntheticTask):
        c = dataset.config
        return DataShape(7, 2 if c.state else 0, 1 + int(c.wrist_image))
    if isinstance(dataset, Mixture):
        shapes = {s.name: _source_shape(s) for s in dataset.sources}
        if len(set(shapes.values())) > 1:
            raise DatasetError(
                "the datasets of the mixture give different inputs to one OFT model "
                f"(action dim, state dim, cameras): {shapes}; give them key configs that agree "
                "(--data-config)"
            )
        return next(iter(shapes.values()))
    stats = next(iter(dataset.statistics.values()))
    return DataShape(len(stats["action"]["q01"]), 0, 1)


def _source_shape(source) -> DataShape:
    images = 1 + int(source.config.wrist is not None)
    return DataShape(int(source.action_dim), int(source.state_dim or 0), images)


def stream_kwargs(options: OFTOptions, shape: DataShape) -> dict[str, Any]:
    """The :class:`~parallax.data.StreamLoader` arguments of an OFT run: the cameras and the
    state the model takes, and chunks of ``--action-chunk``."""
    cameras = ("primary", "wrist")[: shape.num_images]
    return {"cameras": cameras, "state": shape.proprio_dim > 0, "chunk": options.chunk}


def with_oft(config, run, shape: Callable[[], DataShape]):
    """``config`` with the OFT options of an ``--action-head l1`` run: the flags' chunk and
    FiLM, the data's sizes and cameras (``shape()``, called only when needed). A config that
    has them already (an OFT checkpoint's) keeps them, if the flags agree; its data is then
    checked batch by batch (:class:`~.batches.OFTBatchBuilder`)."""
    options: OFTOptions = run.family_options
    if config.oft is not None:
        asked = (options.chunk, options.film)
        if (config.oft.chunk, config.oft.film) != asked:
            raise ValueError(
                f"--model {run.model} is an OFT model for {config.oft}; this run's flags ask "
                f"for chunks of {asked[0]}, FiLM {'on' if asked[1] else 'off'}"
            )
        return config
    got = shape()
    oft = OFTConfig(
        chunk=options.chunk,
        action_dim=got.action_dim,
        proprio_dim=got.proprio_dim,
        num_images=got.num_images,
        film=options.film,
    )
    return dataclasses.replace(config, oft=oft)

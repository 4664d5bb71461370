"""What ``--data`` opens for pi0: the synthetic task's pi0 form here; LeRobot datasets and
LIBERO in :mod:`.robot_data`.

The pi0 form of :mod:`parallax.data.synthetic`: a static third-person camera and the wrist
camera (the model's first two camera slots; further slots are absent cameras), the gripper's
position as the state, chunks of the model's horizon, episodes a few steps longer than a chunk,
images rendered at the tower's resolution. :class:`IndexedSamples` adds each sample's index
and the epoch of the data order that serves it (its ``visit``): the flow-matching noise and
time of a sample are drawn from ``(seed, index, visit)`` (:mod:`.batches`), so they are the
same whatever the layout, and again the same after a resume (the loader's position says the
epoch; a count kept by each process would restart at 0 and differ between dp ranks).
"""

from __future__ import annotations

from typing import Any

from parallax.data.synthetic import SyntheticTask
from parallax.families.pi0.config import Pi0Config

SYNTHETIC_EXTRA_STEPS = 4  # episodes of chunk + 4 steps: 5 samples each
# a sample's cameras, in the model's slot order (the synthetic task has the first two)
CAMERAS = ("image", "wrist_image", "extra_image")


def synthetic_task(config: Pi0Config, seed: int, **overrides: Any) -> SyntheticTask:
    """The synthetic task's pi0 form (module doc)."""
    kw = dict(
        seed=seed,
        camera="static",
        wrist_image=True,
        state=True,
        chunk=config.chunk,
        episode_length=config.chunk + SYNTHETIC_EXTRA_STEPS,
        image_size=config.vision.image_size,
        action_levels=0,  # continuous, as pi0 regresses them (the levels are OpenVLA's bins)
    )
    return SyntheticTask(**{**kw, **overrides})


class IndexedSamples:
    """A random-access dataset whose samples carry ``index`` and ``visit`` (the epoch that
    serves them: :meth:`read_in_epoch`, which the loader calls; plain indexing is visit 0):
    see the module doc. ``statistics``: what the samples are normalised by, when not the
    dataset's own (a policy folder's processors)."""

    def __init__(self, dataset: Any, statistics: dict | None = None) -> None:
        self.dataset = dataset
        self._statistics = statistics

    @property
    def statistics(self) -> dict:
        return self.dataset.statistics if self._statistics is None else self._statistics

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return self.read_in_epoch(index, 0)

    def read_in_epoch(self, index: int, epoch: int) -> dict:
        """Sample ``index`` as epoch ``epoch`` of the data order serves it."""
        sample = dict(self.dataset[index])
        sample["index"], sample["visit"] = int(index), int(epoch)
        return sample

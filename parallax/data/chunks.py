"""Samples of episodes when each sample carries the next ``K`` actions (OpenVLA-OFT's action
chunks), for every episodic source: parallax episode folders, RLDS, LIBERO and LeRobot read in
place, and the streaming loader.

OpenVLA-OFT's rule (its RLDS ``chunk_act_obs`` with ``window_size=1`` and
``future_action_window_size=K-1``): a ``T``-step episode keeps its first ``T - K + 1`` steps as
samples, so every chunk lies inside the episode; an episode shorter than ``K`` gives none. (Its
gather also clamps the future indices to the last step, repeating the final action, which that
truncation never reaches: :func:`action_chunk` does the same.)

LeRobot's rule (pi0, pi0.5): every step is a sample; the chunk's indices past the episode's
end are clamped to its last step and flagged (``action_is_pad``, :func:`chunk_pad`), for the
loss to leave them out.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import numpy as np

from parallax.data.stats import DatasetError

log = logging.getLogger(__name__)


def chunk_lengths(lengths, chunk: int) -> np.ndarray:
    """Samples per episode when each sample carries the next ``chunk`` actions."""
    return np.maximum(np.asarray(lengths, dtype=np.int64) - (chunk - 1), 0)


def action_chunk(actions: np.ndarray, step: int, chunk: int) -> np.ndarray:
    """Actions ``step .. step + chunk - 1`` of an episode ``(T, D)`` -> ``(chunk, D)``, indices
    past the end clamped to the last step (OFT's padding: the final action repeated)."""
    index = np.minimum(np.arange(step, step + chunk), len(actions) - 1)
    return np.asarray(actions, dtype=np.float32)[index]


def chunk_pad(length: int, step: int, chunk: int) -> np.ndarray:
    """``(chunk,)`` bool: which of the actions ``step .. step + chunk - 1`` of a ``length``-step
    episode lie past its end (:func:`action_chunk` repeats the last action there)."""
    return np.arange(step, step + chunk) >= length


class SampleIndex:
    """Sample ``i`` -> ``(episode, step)`` through the episodes in order, each episode giving
    its :func:`chunk_lengths` samples. With ``chunk > 1`` an episode shorter than the chunk is
    named (with its length) in the log, and a dataset none of whose episodes is long enough is a
    :class:`DatasetError` naming the longest."""

    def __init__(self, lengths: Sequence[int], chunk: int = 1, name: str = "the dataset") -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        kept = chunk_lengths(lengths, chunk)
        if chunk > 1:
            _check(lengths, chunk, name)
        self.ends = np.cumsum(kept).tolist()

    def __len__(self) -> int:
        return int(self.ends[-1]) if self.ends else 0

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        episode = bisect.bisect_right(self.ends, index)
        return episode, index - (self.ends[episode - 1] if episode else 0)


def _check(lengths: np.ndarray, chunk: int, name: str) -> None:
    short = np.flatnonzero(lengths < chunk)
    if len(short) == len(lengths):
        raise DatasetError(
            f"{name}: every episode is shorter than the action chunk of {chunk} steps "
            f"(--action-chunk; the longest has {int(lengths.max())}), so none gives a sample"
        )
    if len(short):
        named = ", ".join(f"episode {k} ({int(lengths[k])} steps)" for k in short[:5])
        more = f" and {len(short) - 5} more" if len(short) > 5 else ""
        log.warning(
            "%s: %s%s shorter than the action chunk of %d steps: no sample from them",
            name,
            named,
            more,
            chunk,
        )

"""The order samples are visited in: a pure function of the seed, never of dp, workers or
memory.

**One dataset.** Epoch ``e`` permutes the episodes (seeded by ``(seed, dataset, e)``) and cuts
the permutation into chunks of ``episodes_per_chunk`` episodes; each chunk's samples (every
step of its episodes) are permuted once more, and the epoch is the chunks one after another.
A stretch of the order therefore mixes steps from ``episodes_per_chunk`` episodes, as a
shuffle buffer of that many episodes would, but the buffer is the same for every rank and
holds indices only: a rank reads just the samples of its own share, and a worker keeps only
the episodes it is serving open. Epochs follow each other without a gap (sample ``n`` of the
dataset's stream is sample ``n mod N`` of epoch ``n div N``).

**A mixture.** The global stream is cut into blocks of ``block_size`` positions. Block ``k``
gives dataset ``d`` as many positions as keep its running count within one of ``weight_d x
positions so far`` (largest remainder first, so the frequencies are exact, not sampled), and
a seeded permutation spreads them over the block. Position ``q`` of block ``k`` is then the
``n``-th sample of its dataset, ``n`` = that dataset's count before block ``k`` plus the
position's rank among the block's positions of the same dataset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from parallax.seeds import param_seed


def _perm(n: int, seed: int, name: str) -> np.ndarray:
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randperm(n, generator=gen).numpy()


class SourceOrder:
    """Sample ``n`` of one dataset's endless stream -> ``(epoch, episode, step)``."""

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        seed: int,
        key: str,
        episodes_per_chunk: int = 64,
        shuffle: bool = True,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.total = int(self.lengths.sum())
        self.seed, self.key, self.shuffle = seed, key, shuffle
        self.chunk = max(int(episodes_per_chunk), 1)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._chunks: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = (
            OrderedDict()
        )

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's episode order and where each chunk starts (in samples)."""
        if epoch not in self._epochs:
            n = len(self.lengths)
            order = _perm(n, self.seed, f"{self.key}.epoch.{epoch}") if self.shuffle else None
            order = np.arange(n) if order is None else order
            ends = np.cumsum(self.lengths[order])
            starts = np.concatenate([[0], ends[self.chunk - 1 :: self.chunk]])
            self._epochs[epoch] = (order, starts)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def _chunk(self, epoch: int, c: int):
        """Chunk ``c`` of ``epoch``: its episodes, their sample ends, the sample permutation."""
        if (epoch, c) not in self._chunks:
            order, starts = self._epoch(epoch)
            episodes = order[c * self.chunk : (c + 1) * self.chunk]
            ends = np.cumsum(self.lengths[episodes])
            size = int(ends[-1])
            name = f"{self.key}.epoch.{epoch}.chunk.{c}"
            perm = _perm(size, self.seed, name) if self.shuffle else np.arange(size)
            self._chunks[(epoch, c)] = (episodes, ends, perm)
            while len(self._chunks) > 4:
                self._chunks.popitem(last=False)
        return self._chunks[(epoch, c)]

    def locate(self, n: int) -> tuple[int, int, int]:
        """``(epoch, episode, step)`` of the stream's sample ``n``."""
        epoch, offset = divmod(int(n), self.total)
        _, starts = self._epoch(epoch)
        c = int(np.searchsorted(starts, offset, side="right")) - 1
        episodes, ends, perm = self._chunk(epoch, c)
        i = int(perm[offset - starts[c]])
        j = int(np.searchsorted(ends, i, side="right"))
        return epoch, int(episodes[j]), i - (int(ends[j - 1]) if j else 0)


class MixtureOrder:
    """Global position ``q`` -> ``(dataset, n)``: its dataset and its index in that dataset's
    stream (see the module doc). Each block's starting counts are kept from the oldest block
    still needed (:meth:`state_at` drops older ones); they are the loader's saved state."""

    def __init__(self, weights: Sequence[float], *, seed: int, block_size: int = 1024) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"mixture weights must be non-negative with a positive sum: {weights}")
        self.weights = w / w.sum()
        self.seed, self.block_size = seed, int(block_size)
        self._starts: dict[int, np.ndarray] = {0: np.zeros(len(w), dtype=np.int64)}
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _quota(self, counts: np.ndarray, block: int) -> np.ndarray:
        """Each dataset's positions in ``block``, given its counts before it."""
        target = self.weights * (block + 1) * self.block_size - counts
        take = np.maximum(np.floor(target), 0).astype(np.int64)
        short = self.block_size - int(take.sum())
        if short > 0:  # largest remainders first, ties to the first dataset
            rest = target - take
            take[np.lexsort((np.arange(len(rest)), -rest))[:short]] += 1
        return take

    def _start(self, block: int) -> np.ndarray:
        """Each dataset's count before ``block``."""
        if block < min(self._starts):
            raise ValueError(f"block {block} is behind the kept state (block {min(self._starts)})")
        for k in range(max(self._starts), block):
            self._starts[k + 1] = self._starts[k] + self._quota(self._starts[k], k)
        return self._starts[block]

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Per position of ``block``: its dataset, and its rank among that dataset's ones."""
        if block not in self._blocks:
            quota = self._quota(self._start(block), block)
            labels = np.repeat(np.arange(len(quota)), quota)
            if len(quota) > 1:
                labels = labels[_perm(self.block_size, self.seed, f"mixture.block.{block}")]
            rank = np.zeros(self.block_size, dtype=np.int64)
            for d in np.flatnonzero(quota):
                where = labels == d
                rank[where] = np.arange(int(quota[d]))
            self._blocks[block] = (labels, rank)
            while len(self._blocks) > 4:
                self._blocks.popitem(last=False)
        return self._blocks[block]

    def locate(self, q: int) -> tuple[int, int]:
        block, j = divmod(int(q), self.block_size)
        labels, rank = self._block(block)
        d = int(labels[j])
        return d, int(self._start(block)[d] + rank[j])

    def state_at(self, position: int) -> dict:
        """What resuming at global ``position`` needs; forgets the blocks before it."""
        block = int(position) // self.block_size
        counts = self._start(block)
        for k in [k for k in self._starts if k < block]:
            del self._starts[k]
        return {"block": block, "counts": [int(c) for c in counts], "block_size": self.block_size}

    def load_state(self, state: dict) -> None:
        if int(state["block_size"]) != self.block_size or len(state["counts"]) != len(self.weights):
            raise ValueError("the saved mixture position is for another mixture layout")
        self._starts = {int(state["block"]): np.asarray(state["counts"], dtype=np.int64)}
        self._blocks.clear()

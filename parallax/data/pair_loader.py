"""The pair loader: one seeded global stream of pairs, sliced per dp rank, resumable exactly.

Each epoch's stream depends on ``(seed, epoch)`` and the data only: the shards in an order drawn
from ``(seed, epoch)``, cut into windows of ``window_shards`` consecutive shards, each window's
samples permuted by ``(seed, epoch, window)`` (a full shuffle of a folder, which is one shard).
A step takes the next ``global_batch_size`` pairs of the stream (across windows; an incomplete
tail at the end of the epoch is dropped); dp rank ``r`` takes the ``r``-th contiguous block of
``global_batch_size / dp`` and cuts it into microbatches. So the global batch is the same at any
dp, and a rank reads (decodes) only its own samples; every rank indexes the headers of the
shards in the windows it passes through.

The position is ``(epoch, window, offset)``: ``load_state_dict`` continues at exactly the next
pair, also under another dp or micro-batch size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from parallax.data.loader import DPBatches
from parallax.data.pairs import PairSample, PairSource
from parallax.data.stats import DatasetError
from parallax.seeds import param_seed

log = logging.getLogger(__name__)


class PairLoader(DPBatches):
    """Yields, per step, this dp rank's microbatches (lists of raw pairs)."""

    def __init__(
        self,
        source: PairSource,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        window_shards: int = 16,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size)
        if window_shards < 1:
            raise ValueError(f"window_shards must be >= 1, got {window_shards}")
        self.source = source
        self.seed, self.shuffle, self.window_shards = seed, shuffle, window_shards
        self.epoch = self.window = self.offset = 0
        self.samples_seen = 0
        self._cache: tuple[tuple[int, int], torch.Tensor] | None = None

    def _gen(self, what: str) -> torch.Generator:
        return torch.Generator().manual_seed(param_seed(self.seed, what))

    def shard_order(self, epoch: int) -> list[int]:
        n = self.source.num_shards()
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=self._gen(f"pairs.epoch.{epoch}.shards")).tolist()

    def num_windows(self) -> int:
        return -(-self.source.num_shards() // self.window_shards)

    def window_refs(self, epoch: int, window: int) -> torch.Tensor:
        """``(n, 2)`` int64 ``(shard, index)`` of the window's samples, in stream order."""
        if self._cache is not None and self._cache[0] == (epoch, window):
            return self._cache[1]
        shards = self.shard_order(epoch)[window * self.window_shards :][: self.window_shards]
        refs = [
            torch.stack([torch.full((n,), s), torch.arange(n)], dim=1)
            for s in shards
            if (n := self.source.shard_length(s)) > 0
        ]
        refs = torch.cat(refs) if refs else torch.zeros((0, 2), dtype=torch.long)
        if self.shuffle and len(refs):
            gen = self._gen(f"pairs.epoch.{epoch}.window.{window}")
            refs = refs[torch.randperm(len(refs), generator=gen)]
        self._cache = ((epoch, window), refs)
        return refs

    def next_global_refs(self) -> list[tuple[int, int]]:
        """Advance by one step; the whole global batch's ``(shard, index)`` references."""
        out: list[torch.Tensor] = []
        need, restarted = self.global_batch_size, False
        while need:
            if self.window >= self.num_windows():  # the epoch ends: drop the incomplete tail
                if restarted:
                    raise DatasetError(
                        f"pair source {self.source.name!r} holds fewer pairs than one global "
                        f"batch of {self.global_batch_size}"
                    )
                self.epoch, self.window, self.offset = self.epoch + 1, 0, 0
                out, need, restarted = [], self.global_batch_size, True
                continue
            refs = self.window_refs(self.epoch, self.window)
            take = refs[self.offset : self.offset + need]
            out.append(take)
            need -= len(take)
            self.offset += len(take)
            if self.offset >= len(refs):
                self.window, self.offset = self.window + 1, 0
        self.samples_seen += self.global_batch_size
        return [tuple(r) for r in torch.cat(out).tolist()]

    def next_batch(self) -> list[list[PairSample]]:
        return self.my_microbatches(self.next_global_refs(), lambda r: self.source.read(*r))

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position; identical on every rank."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "window_shards": self.window_shards,
            "num_shards": self.source.num_shards(),
            "epoch": self.epoch,
            "window": self.window,
            "offset": self.offset,
            "samples_seen": self.samples_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (its seed, shuffle and window size win)."""
        if int(state["num_shards"]) != self.source.num_shards():
            raise DatasetError(
                f"the saved data position is for {state['num_shards']} shards, but "
                f"{self.source.name!r} has {self.source.num_shards()}: resume with the same data"
            )
        if int(state["seed"]) != self.seed:
            log.warning("pair order follows the saved seed %s, not %s", state["seed"], self.seed)
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.window_shards = int(state["window_shards"])
        self.epoch, self.window = int(state["epoch"]), int(state["window"])
        self.offset, self.samples_seen = int(state["offset"]), int(state["samples_seen"])
        self._cache = None

"""The data loader: one seeded global order, sliced per data-parallel rank, resumable exactly.

Each epoch's order is a permutation of all samples drawn from ``(seed, epoch)``. A step takes
the next ``global_batch_size`` samples of that order (an incomplete tail is dropped; the next
epoch starts a fresh permutation). Data-parallel rank ``r`` of ``dp`` takes the contiguous
``r``-th block of ``global_batch_size / dp`` samples and cuts it into microbatches of
``micro_batch_size``; so the global batch, and its order, is the same whatever ``dp`` is, and
only this rank's samples are ever read. Tensor- and pipeline-parallel peers build the loader
with the same ``dp_rank`` and see the same microbatches.

The position is ``(epoch, offset)``, a sample index into the epoch's order, so
``load_state_dict`` resumes at exactly the next sample, also under another dp size or
micro-batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from parallax.data.episodes import EpisodeDataset, Sample
from parallax.data.mixture import detect_format, open_source, parse_data_spec
from parallax.data.source import SourceDataset
from parallax.data.stats import DatasetError
from parallax.data.synthetic import SyntheticTask
from parallax.seeds import param_seed

log = logging.getLogger(__name__)
T = TypeVar("T")


class Dataset(Protocol):
    """What the loader needs: random access to raw samples, a name and the statistics."""

    name: str
    statistics: dict[str, Any]

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


def load_dataset(
    spec: str, *, seed: int = 0, image_size: int | None = None, chunk: int = 1
) -> Dataset:
    """``"synthetic"`` for the built-in task (``seed``, ``image_size``), else a dataset dir:
    parallax's episode format, or ``rlds:PATH`` / ``lerobot:PATH`` / ``libero:PATH`` / a
    directory in one of those formats, read in place (random access; the streaming loader
    :class:`~parallax.data.stream.StreamLoader` is the faster way to train on them). With
    ``chunk > 1`` a directory's samples carry the next ``chunk`` actions
    (:mod:`parallax.data.chunks`)."""
    if spec == "synthetic":
        return SyntheticTask(seed=seed, **({"image_size": image_size} if image_size else {}))

    specs = parse_data_spec(spec)
    if len(specs) > 1 or specs[0].weight is not None:
        raise DatasetError(
            f"--data {spec!r} is a mixture: mixtures stream through StreamLoader (load_mixture)"
        )
    (one,) = specs
    fmt = one.format
    if fmt is None and Path(one.path).is_dir():
        try:
            fmt = detect_format(one.path)
        except DatasetError:  # nothing known: the episode reader says what is missing
            fmt = None
    if fmt in (None, "parallax"):
        return EpisodeDataset(one.path, chunk=chunk)
    return SourceDataset(open_source(one), chunk=chunk)


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, dp_size: int) -> None:
    """Raise a ``ValueError`` naming the numbers and what would work unless
    ``global_batch_size`` is a multiple of ``micro_batch_size * dp_size``."""
    for label, value in (
        ("global batch size", global_batch_size),
        ("micro batch size", micro_batch_size),
        ("dp size", dp_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    unit = micro_batch_size * dp_size
    if global_batch_size % unit == 0:
        return
    below = global_batch_size // unit * unit
    multiples = [m for m in (below, below + unit) if m > 0]
    hint = f"a global batch size that is a multiple of {unit} ({' or '.join(map(str, multiples))})"
    if global_batch_size % dp_size == 0:
        per_rank = global_batch_size // dp_size
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        hint += f", or a micro batch size that divides {per_rank}: {divisors}"
    raise ValueError(
        f"global batch size {global_batch_size} is not divisible by micro batch size "
        f"{micro_batch_size} x dp {dp_size} = {unit}; use {hint}"
    )


class DPBatches:
    """What every loader shares: the global batch of a step, this dp rank's contiguous share
    of it cut into microbatches, and iteration by :meth:`next_batch`."""

    def __init__(
        self, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> None:
        check_batch_sizes(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp rank {dp_rank} is outside [0, dp size {dp_size})")
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each dp rank (the gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    def my_microbatches(self, batch: Sequence[T], read: Callable[[T], Any]) -> list[list[Any]]:
        """This rank's block of the global ``batch`` (its references), read and cut into
        microbatches."""
        local, m = self.local_batch_size, self.micro_batch_size
        mine = batch[self.dp_rank * local : (self.dp_rank + 1) * local]
        return [[read(x) for x in mine[k : k + m]] for k in range(0, local, m)]

    def next_batch(self) -> list[list[Any]]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[list[Any]]]:
        return self

    def __next__(self) -> list[list[Any]]:
        return self.next_batch()


class BatchLoader(DPBatches):
    """Yields, per step, this dp rank's share of the global batch as a list of microbatches
    (each a list of raw samples). See the module doc for the order and resume guarantees."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size)
        if len(dataset) < global_batch_size:
            what = "is empty" if len(dataset) == 0 else f"has only {len(dataset)} samples"
            raise DatasetError(
                f"dataset {getattr(dataset, 'name', '')!r} {what}, fewer than one global batch "
                f"of {global_batch_size}"
            )
        self.dataset = dataset
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.offset = 0  # index of the next sample in this epoch's order
        self.samples_seen = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch_size

    def order(self, epoch: int) -> torch.Tensor:
        """The global sample order of ``epoch``: (len(dataset),) int64, same on every rank."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                gen = torch.Generator().manual_seed(param_seed(self.seed, f"data.epoch.{epoch}"))
                self._order = torch.randperm(n, generator=gen)
            else:
                self._order = torch.arange(n)
            self._order_epoch = epoch
        return self._order

    def next_global_indices(self) -> list[int]:
        """Advance by one step and return the whole global batch's sample indices."""
        if self.offset + self.global_batch_size > len(self.dataset):
            self.epoch, self.offset = self.epoch + 1, 0  # drop the incomplete tail
        start = self.offset
        indices = self.order(self.epoch)[start : start + self.global_batch_size].tolist()
        self.offset += self.global_batch_size
        self.samples_seen += self.global_batch_size
        return indices

    def next_batch(self) -> list[list[Sample]]:
        """This rank's ``num_microbatches`` microbatches of ``micro_batch_size`` samples. A
        dataset with ``read_in_epoch(index, epoch)`` is told the epoch each sample is served in
        (pi0 draws a sample's flow-matching noise from it)."""
        indices = self.next_global_indices()
        read = getattr(self.dataset, "read_in_epoch", None)
        if read is None:
            return self.my_microbatches(indices, self.dataset.__getitem__)
        epoch = self.epoch
        return self.my_microbatches(indices, lambda i: read(i, epoch))

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position; identical on every rank."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "offset": self.offset,
            "samples_seen": self.samples_seen,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (its seed and shuffle win, so the order is the saved one)."""
        if int(state["dataset_size"]) != len(self.dataset):
            raise DatasetError(
                f"the saved data position is for a dataset of {state['dataset_size']} samples, "
                f"but {getattr(self.dataset, 'name', 'this dataset')!r} has {len(self.dataset)}: "
                "resume with the same data"
            )
        if int(state["seed"]) != self.seed:
            log.warning("data order follows the saved seed %s, not %s", state["seed"], self.seed)
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.samples_seen = int(state["samples_seen"])
        self._order_epoch = -1

"""The dual encoders' data for the trainer: ``--data`` specs and the random-access view the
evaluation reads (the collator that turns raw pairs into microbatches is
:mod:`parallax.families.siglip.batches`).

``--data`` is ``synthetic`` (or ``synthetic:N`` pairs; the built-in coloured-shapes task of
:mod:`parallax.data.synthetic_pairs`), a folder with ``captions.jsonl`` / ``captions.csv``, or
WebDataset tar shards (a directory of ``*.tar`` or one ``.tar`` file); ``folder:PATH`` and
``tar:PATH`` say which explicitly. Training streams them through
:class:`~parallax.data.PairLoader` (rank-sharded shuffling, exact resume); the evaluation reads
its split through :class:`IndexedPairs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parallax.data import PairFolder, SyntheticPairs, TarShards
from parallax.data.stats import DatasetError

SYNTHETIC_SIZE = 4096  # pairs of the default training task


def open_pairs(spec: str, image_size: int, seed: int, split: str = "train") -> Any:
    """The pair source ``--data spec`` names (see the module doc)."""
    kind, sep, rest = spec.partition(":")
    if kind == "synthetic":
        size = SYNTHETIC_SIZE
        if sep:
            if not rest.isdigit() or int(rest) < 1:
                raise ValueError(f"--data {spec!r}: synthetic:N takes a positive pair count")
            size = int(rest)
        return SyntheticPairs(seed=seed, size=size, image_size=max(16, image_size), split=split)
    if sep and kind in ("folder", "tar"):
        path = Path(rest)
    else:
        path, kind = Path(spec), ""
    if not path.exists():
        raise DatasetError(
            f"--data {spec!r}: no such file or directory (give 'synthetic', a folder with "
            "captions.jsonl/.csv, or WebDataset tar shards)"
        )
    if kind == "folder" or (
        not kind
        and path.is_dir()
        and any((path / n).is_file() for n in ("captions.jsonl", "captions.csv"))
    ):
        return PairFolder(path)
    return TarShards(path)


class IndexedPairs:
    """Random access (``len``, ``[i]``) over every shard of a pair source, in order: what the
    Evaluator's fixed-order loader reads. Indexes every shard's header once."""

    statistics: dict = {}

    def __init__(self, source: Any) -> None:
        self.source, self.name = source, source.name
        self.starts = [0]
        for s in range(source.num_shards()):
            self.starts.append(self.starts[-1] + source.shard_length(s))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> dict:
        shard = next(s for s in range(len(self.starts) - 1) if i < self.starts[s + 1])
        return self.source.read(shard, i - self.starts[shard])

    def class_names(self) -> list[str] | None:
        names = getattr(self.source, "class_names", None)
        return names() if callable(names) else None

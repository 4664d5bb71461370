"""Length-grouped batching, as LLaVA's modality-length sampler does it, for variable sequences.

LLaVA-NeXT samples range from ~100 tokens (text only) to ~3k (an image of 5 tiles), and a
microbatch is right-padded to its longest sample: ``input_ids`` with the pad id, ``labels`` with
-100, ``pixel_values`` with zero tiles (never run through the tower, the model reads the tile
count from ``image_sizes``). Every padding token still runs through every decoder layer, so
mixing a 100-token and a 3k-token sample wastes almost half the language-model compute.

:func:`length_grouped_order` keeps the loader's contract (one global order from the seed and the
epoch, the same at every dp size and rank) and only rearranges each global batch: its samples
are sorted by (has an image, length), cut into microbatches of neighbours, and the microbatches
are dealt to the dp ranks longest first, each to the rank with the fewest padded tokens so far,
so ranks finish their steps at about the same time. Which samples form a global batch is the
random permutation of :class:`~parallax.data.BatchLoader`; the loss, normalised by the
supervised tokens of the whole global batch, does not depend on how the batch is dealt.
:func:`padding_fraction` measures what padding remains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallax.data.loader import BatchLoader, Dataset
from parallax.seeds import param_seed


def _deal(batch: list[int], lengths, images, micro: int, dp: int) -> list[int]:
    """One global batch rearranged: rank ``r``'s microbatches are its ``r``-th contiguous block."""
    batch = sorted(batch, key=lambda i: (images[i], lengths[i], i))
    mbs = [batch[k : k + micro] for k in range(0, len(batch), micro)]
    mbs.sort(key=lambda mb: -max(lengths[i] for i in mb) * len(mb))
    per_rank = len(mbs) // dp
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    cost = [0] * dp
    for mb in mbs:
        r = min((r for r in range(dp) if len(ranks[r]) < per_rank), key=lambda r: (cost[r], r))
        ranks[r].append(mb)
        cost[r] += max(lengths[i] for i in mb) * len(mb)
    return [i for rank in ranks for mb in rank for i in mb]


def length_grouped_order(
    lengths: Sequence[int],
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_size: int = 1,
    seed: int = 0,
    epoch: int = 0,
    has_image: Sequence[bool] | None = None,
) -> torch.Tensor:
    """The epoch's global order ``(n,)``: the loader's permutation with each complete global
    batch rearranged as the module doc says (an incomplete tail, which the loader drops, is left
    as it is)."""
    n = len(lengths)
    images = list(has_image) if has_image is not None else [True] * n
    gen = torch.Generator().manual_seed(param_seed(seed, f"data.epoch.{epoch}"))
    perm = torch.randperm(n, generator=gen).tolist()
    g = global_batch_size
    out = []
    for start in range(0, n - n % g, g):
        out += _deal(perm[start : start + g], lengths, images, micro_batch_size, dp_size)
    return torch.tensor(out + perm[n - n % g :], dtype=torch.long)


def padding_fraction(lengths: Sequence[int], microbatches: Sequence[Sequence[int]]) -> float:
    """Share of the tokens run that are padding: ``1 - sum(len) / sum(b x max len)``."""
    real = sum(lengths[i] for mb in microbatches for i in mb)
    run = sum(len(mb) * max(lengths[i] for i in mb) for mb in microbatches)
    return 1.0 - real / run if run else 0.0


class LengthGroupedLoader(BatchLoader):
    """:class:`~parallax.data.BatchLoader` whose order is :func:`length_grouped_order` of the
    samples' token ``lengths`` (and ``has_image``); resume and dp slicing are unchanged."""

    def __init__(
        self,
        dataset: Dataset,
        lengths: Sequence[int],
        has_image: Sequence[bool] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(dataset, **kwargs)
        if len(lengths) != len(dataset):
            raise ValueError(f"{len(lengths)} lengths for a dataset of {len(dataset)} samples")
        self.lengths, self.has_image = list(lengths), has_image

    def order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = length_grouped_order(
                    self.lengths,
                    global_batch_size=self.global_batch_size,
                    micro_batch_size=self.micro_batch_size,
                    dp_size=self.dp_size,
                    seed=self.seed,
                    epoch=epoch,
                    has_image=self.has_image,
                )
            else:
                self._order = torch.arange(len(self.dataset))
            self._order_epoch = epoch
        return self._order

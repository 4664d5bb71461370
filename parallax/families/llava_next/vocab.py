"""The rows an original-layout LLaVA checkpoint lacks: its 32000-row vocabulary made llava-hf's.

The Hugging Face converter adds ``<image>`` (32000) and ``<pad>`` (32001), pads the vocabulary to
a multiple of 64 (32064) and fills every new row of both the embedding and lm_head with a sample
of N(mu, 1e-5 x Sigma), where mu and Sigma are the mean and covariance of the *embedding's* old
rows. The converter's samples are random; here they are deterministic: row ``j`` is

    mu + sqrt(1e-5 / n) x sum_i W[j, i] (x_i - mu)

with ``x_i`` the ``n`` old embedding rows and ``W`` a fixed standard-normal matrix drawn from
``param_seed(0, "llava.added_rows")`` (rows ``0..k-1`` for the embedding, ``k..2k-1`` for
lm_head). That is exactly a draw from N(mu, 1e-5 x Sigma), without forming the h x h covariance,
and it sums over the old rows: each tp rank adds up its own slice and one all-reduce over the tp
group finishes it, so no rank reads more than its slice. A last stage that holds lm_head but not
the embedding reads its slice of the embedding's rows for these statistics (the only bytes an
original checkpoint costs beyond a rank's own parameters). None of the new ids is ever a target:
they only enter the softmax normaliser and the embeddings of ``<image>`` (replaced by features)
and ``<pad>``.
"""

from __future__ import annotations

import math

import torch

from parallax import comm
from parallax.seeds import param_seed
from parallax.tensor import TPShard

SCALE = 1e-5  # the converter's covariance factor
SEED_NAME = "llava.added_rows"


class AddedRows:
    """This rank's slice of the embedding's stored rows and the added rows' values (the tp
    collective runs in the constructor, on every tp rank of a stage holding either tensor)."""

    def __init__(self, reader, embed_name: str, info: TPShard, ctx, vocab_size: int) -> None:
        stored = reader.shapes()[embed_name]
        self.old, self.new, hidden = stored[0], vocab_size, stored[1]
        (self.start, self.stop), k = info.ranges()[0], vocab_size - stored[0]
        lo, hi = self.start, min(self.stop, self.old)
        if lo < hi:
            self._x = reader.read(embed_name, 0, lo, hi)  # (hi - lo, h), checkpoint dtype
        else:
            self._x = torch.zeros(0, hidden)  # this rank holds added rows (or padding) only
        gen = torch.Generator().manual_seed(param_seed(0, SEED_NAME))
        w = torch.randn(2 * k, self.old, generator=gen)  # (2k, n): the same on every rank
        x = self._x.float()
        part = torch.cat([x.sum(0, keepdim=True), w[:, lo : max(lo, hi)] @ x])  # (1 + 2k, h)
        comm.all_reduce(part, None if ctx is None else ctx.tp_group)
        mu = part[0] / self.old
        self.rows = mu + math.sqrt(SCALE / self.old) * (part[1:] - w.sum(1, keepdim=True) * mu)
        self.k = k

    def embed_slice(self) -> torch.Tensor:
        """This rank's rows of the embedding as stored, zero where the checkpoint has none."""
        local = self.stop - self.start
        pad = torch.zeros(local - self._x.shape[0], self._x.shape[1], dtype=self._x.dtype)
        return torch.cat([self._x, pad])  # (V/tp, h)

    def fill(self, local: torch.Tensor, head: bool) -> torch.Tensor:
        """``local`` (this rank's rows ``start..stop``) with the added rows written in; rows past
        the vocabulary (tp padding) stay zero."""
        rows = self.rows[self.k :] if head else self.rows[: self.k]  # (k, h)
        a, b = max(self.start, self.old), min(self.stop, self.new)
        if a < b:
            local[a - self.start : b - self.start] = rows[a - self.old : b - self.old]
        return local

"""How the offload's worker steps one bucket on the host and sends its weights up
(:class:`~parallax.optim.zero.offload.host_steps.HostSteps` says when).

With torch's kernel (``--host-adamw torch``) the bucket's summed gradient is made in fp32 in one
scratch buffer (the accumulator upcast, or a kept bucket's sum brought down), the wrapped
optimizer steps the bucket's pieces on it (the dp average and the clip coefficient folded into a
fused kernel's ``grad_scale``), and the new masters are converted into the upload ring. With
``--host-adamw one-pass`` (:mod:`~parallax.optim.zero.offload.host_adamw`) one loop per piece
reads the sums in the model's dtype and writes the new weights over them (on GPUs; a kept bucket's
into the ring), and they go up from there.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from parallax.optim.zero.bucketwise import step_bucket
from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.offload.accumulators import Accumulators
from parallax.optim.zero.offload.downloads import Downloads
from parallax.optim.zero.offload.host_adamw import HostAdamW, check_supported
from parallax.optim.zero.offload.host_kernels import host_threads
from parallax.optim.zero.offload.uploads import Uploads
from parallax.optim.zero.offload.weights_down import WeightsDown
from parallax.optim.zero.torch_contract import grad_scale, takes_grad_scale

log = logging.getLogger(__name__)


class BucketSteps:
    """The worker's steps of ``buckets`` (offloaded, in the layout's order) of ``flat`` with
    ``inner`` (the worker's handle), on the sums in ``sums``, each piece in its group
    (``piece_groups``), at ``dp`` ranks; ``one_pass``: ``--host-adamw one-pass``."""

    def __init__(
        self,
        flat: FlatBuffers,
        inner: torch.optim.Optimizer,
        buckets: list[int],
        sums: Accumulators,
        piece_groups: Sequence[int],
        dp: int,
        one_pass: bool,
    ) -> None:
        self.flat, self.inner, self.buckets, self.dp = flat, inner, buckets, dp
        self.sums, self.acc, self.kept = sums, sums.acc, sums.kept
        self.piece_groups = piece_groups
        self.fold = takes_grad_scale(inner)  # the kernel scales the gradients itself
        self.pieces_of_bucket: list[list[int]] = [[] for _ in flat.layout.buckets]
        for k, pc in enumerate(flat.pieces):
            self.pieces_of_bucket[pc.bucket].append(k)
        device = sums.device
        layout = flat.layout
        totals: dict[torch.dtype, int] = defaultdict(int)  # offloaded elements of each dtype
        for b in buckets:
            totals[layout.dtypes[layout.buckets[b].buffer]] += layout.buckets[b].chunk
        most = max(layout.buckets[b].chunk for b in buckets)
        self.up, self.down = Uploads(dict(totals), most, device), Downloads(self.kept, device)
        self.split = [b for b in buckets if b in flat.split]  # masters held as low halves
        self.weights = WeightsDown(flat, self.split, self.up.stream)
        self.scratch = torch.empty(0)  # fp32: the gradient being stepped (grown to the need)
        if self.split and not one_pass:
            raise ValueError("split masters are stepped by the one-pass host AdamW alone")
        self.one_pass = self._one_pass(device.type == "cuda") if one_pass else None
        self.reset()

    def _one_pass(self, on_device: bool) -> HostAdamW | None:
        """``--host-adamw one-pass``'s kernels for the clipped step (bf16 sums in, new bf16
        weights out), compiled for the worker on GPUs; None where torch cannot compile them
        (torch's fused kernel steps then)."""
        check_supported(type(self.inner), self.inner.param_groups)
        layout = self.flat.layout
        dtypes = {b: layout.dtypes[layout.buckets[b].buffer] for b in self.buckets}
        kernel = HostAdamW(compiled=on_device)
        whole = [b for b in self.buckets if b not in self.flat.split]
        in_place = {dtypes[b] for b in whole if b not in self.kept}
        out = {dtypes[b] for b in whole if b in self.kept}
        split = {"out" if b in self.kept else "in_place" for b in self.split}
        if kernel.prepare(in_place, out, host_threads(), sorted(split)):
            return kernel
        if self.split:  # (no kernel of torch's steps a split master)
            log.warning("--host-masters split: torch cannot compile its step here; it runs eager")
            return HostAdamW(compiled=False)
        log.warning("--host-adamw one-pass: torch cannot compile it here; torch's kernel steps")
        return None

    def reset(self) -> None:
        """A new step: no bucket stepped, no weights written."""
        self.stepped = dict.fromkeys(self.buckets, False)
        self.written: dict[int, tuple[torch.Tensor, list | None]] = {}  # bucket -> its weights
        self.unchanged: set[int] = set()  # buckets whose chunk here had nothing to step
        self.down.reset()  # (a trip issued for a bucket that then had nothing to step: stale)
        self.weights.reset()

    def buffers(self) -> list[torch.Tensor]:
        """The host buffers besides the sums: the scratch, the rings and the landing buffers."""
        return [self.scratch, *self.up.buffers(), *self.down.buffers(), *self.weights.buffers()]

    def gradient(self, b: int, then: int | None = None) -> torch.Tensor:
        """Bucket ``b``'s summed fp32 gradient, in the scratch buffer (a kept bucket's brought
        down first; ``then``: the kept bucket to bring down next, under this one's step)."""
        if b not in self.kept:
            acc = self.acc[b]
            grad = self._scratch(acc.numel())  # (bucket/dp,) fp32
            grad.copy_(acc)
            return grad
        grad = self._scratch(self.kept[b].numel())  # (bucket/dp,) fp32
        self.down.into(b, grad, then)
        return grad

    def _scratch(self, n: int) -> torch.Tensor:
        """``n`` elements of the worker's fp32 scratch, grown (rarely: to the largest bucket
        it steps through it) where it is short."""
        if self.scratch.numel() < n:
            self.scratch = torch.empty(n)  # (n,) fp32
        return self.scratch[:n]

    def step(self, b: int, grad: torch.Tensor, flags, scale: float) -> None:
        """Step the bucket's pieces whose parameter has a gradient on some dp rank, on
        ``grad`` times ``scale`` (the dp average and the clip coefficient: folded into
        torch's fused kernel where it takes a ``grad_scale``, one pass over the bucket less)."""
        live = self._live(b, flags)
        folded: AbstractContextManager | None = None
        if scale != 1.0 and self.fold:
            folded = grad_scale(self.inner, torch.full((), 1.0 / scale))
        elif scale != 1.0:
            grad.mul_(scale)
        step_bucket(self.inner, self.flat, live, grad, self.piece_groups, folded)
        self.stepped[b] = True

    def _live(self, b: int, flags) -> list[int]:
        """Bucket ``b``'s pieces whose parameter has a gradient on some dp rank (``flags``)."""
        pieces = self.flat.pieces
        return [k for k in self.pieces_of_bucket[b] if flags[pieces[k].param]]

    def step_later(self, b: int, coef: float | None, flags, seconds: defaultdict) -> None:
        """Bucket ``b``'s step in ``step()``, with the clip coefficient ``coef``."""
        if self.stepped[b]:
            return
        self.stepped[b] = True
        live = self._live(b, flags)
        if not live:  # no piece of this rank's chunk has a gradient: its weights stand
            self.unchanged.add(b)
            return
        scale = (1.0 if coef is None else coef) / self.dp  # (no pass: a zeroed accumulator)
        if self.one_pass is None:
            self.step(b, self.gradient(b, self._next_kept(b)), flags, scale)
        else:
            self._step_one_pass(b, live, scale, seconds)

    def _step_one_pass(self, b: int, live: list[int], scale: float, seconds) -> None:
        """Step bucket ``b``'s ``live`` pieces in one pass each: the accumulator read in its
        dtype and overwritten with the new weights, which go up from there (a kept bucket:
        from its landing copy into staging); the rest of the chunk gets its masters' values.
        Split masters are read from the weights brought down and their low halves."""
        mine = self.flat.own_param(b)
        if b in self.kept:
            grad = self._scratch(self.kept[b].numel())  # (bucket/dp,) fp32
            self.down.into(b, grad, self._next_kept(b))
        else:
            grad = self.acc[b]  # (bucket/dp,) host, the model's dtype
        if b in self.flat.split:  # (bucket/dp,) bf16 weights: the masters' top halves
            master, low = self.weights.get(b, self._next(b, self.split)), self.flat.lows[b]
        else:
            master, low = self.flat.masters[b], None
        dest, ticket = self.up.stage(mine, None if b in self.kept else grad, seconds)
        pieces, done = self.flat.pieces, 0
        todo = []
        for k in sorted(live, key=lambda k: pieces[k].chunk_offset):
            lo, n = pieces[k].chunk_offset, pieces[k].numel
            out = None if dest is grad else dest[lo : lo + n]
            piece = (self.flat.piece_params[k], grad[lo : lo + n], out, self.piece_groups[k])
            halves = () if low is None else ((master[lo : lo + n], low[:, lo : lo + n]),)
            todo.append(piece + halves)
            dest[done:lo].copy_(master[done:lo])  # (a frozen piece, padding: as they were)
            done = lo + n
        dest[done:].copy_(master[done:])
        self.one_pass.step(self.inner, todo, scale)
        self.written[b] = (dest, ticket)

    def _next(self, b: int, among) -> int | None:
        """The bucket of ``among`` that ``step()`` steps after ``b`` (it goes down the
        layout), if any."""
        later = (c for c in reversed(self.buckets) if c < b and c in among)
        return next((c for c in later if not self.stepped[c]), None)

    def _next_kept(self, b: int) -> int | None:
        """The kept bucket ``step()`` steps after ``b``, if any."""
        return self._next(b, self.kept)

    def upload(self, b: int, seconds: defaultdict) -> None:
        """Bucket ``b``'s new weights into the model (its shard at ZeRO-3)."""
        if b in self.written:  # written by the one-pass step
            dest, ticket = self.written.pop(b)
            self.up.send_staged(b, self.flat.own_param(b), dest, ticket)
            return
        if b in self.unchanged:  # nothing of this rank's chunk stepped: its weights stand
            return
        self.up.send(b, self.flat.own_param(b), self.flat.masters[b], seconds)

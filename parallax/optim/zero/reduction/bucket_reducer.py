"""Gradient reduction for ZeRO-1: reduce-scatter each bucket over dp, in fp32, in a fixed order.

Buckets are launched strictly in the layout's order. With ``overlap`` a bucket is launched from
a backward hook once each of its parameters has had its last accumulation of the step
(``backward_passes_per_step`` of them) and every earlier bucket has been launched; whatever is
left is launched by :meth:`GradReducer.finish`. Readiness may differ between dp ranks (a
parameter unused on one rank only) but the order never does, so every rank makes the same
collectives in the same order and a missing gradient delays a bucket instead of hanging it.

Buckets of fp32 gradients are reduced in place: rank ``r``'s chunk of the gradient buffer ends
up holding the dp average of that chunk. Other dtypes are copied into one of two fp32 staging
buffers first and reduced into their fp32 home (``outputs[b]``). Buckets of
``sequence_parallel`` parameters are staged too, summed over tp, then reduced over dp. A bucket
without a home (``outputs[b] is None``: dp=1, its fp32 gradient is made when it is stepped) is
only marked as reduced, so misuse raises the same errors whatever the home.

Which collectives a rank makes depends only on what every rank sees the same: the order of
the optimizer's calls. Buckets are launched from hooks only in a step that ``zero_grad()``
opened (:meth:`GradReducer.reset` with ``open``); ``step()`` closes it. Gradients that arrive
in a closed step (``step(); backward()`` without ``zero_grad()``) wait for ``finish()``. So a
``zero_grad()`` after ``step()`` never has collectives to complete, on any rank, and one in the
middle of a step (:meth:`GradReducer.discard`) completes them on every rank.

On GPUs the staging copies and the collectives are issued on a side stream (``stream``) that
first waits for the compute stream: the bf16 -> fp32 copies then run beside the rest of the
backward instead of in line with it. With ``average=False`` the outputs keep the dp sum and the
caller divides (ZeRO folds the division into a fused optimizer's ``grad_scale``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from parallax import comm
from parallax.context import ParallelContext
from parallax.optim.zero.buffers.packing import FlatLayout

log = logging.getLogger(__name__)


class GradReducer:
    def __init__(
        self,
        layout: FlatLayout,
        grad_buffers: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor | None],
        names: Sequence[str],
        ctx: ParallelContext,
        overlap: bool,
        backward_passes_per_step: int,
        average: bool = True,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.layout, self.grad_buffers, self.outputs = layout, grad_buffers, outputs
        self.average, self.stream = average, stream
        self.names, self.ctx, self.overlap = names, ctx, overlap
        self.passes = backward_passes_per_step
        self.bucket_of = [slot.bucket for slot in layout.slots]
        staged = [
            b.numel
            for b, out in zip(layout.buckets, outputs)
            if out is not None and (b.sequence_parallel or layout.dtypes[b.buffer] != torch.float32)
        ]
        device = grad_buffers[0].device if grad_buffers else torch.device("cpu")
        self.staging = [torch.empty(max(staged), device=device) for _ in range(2)] if staged else []
        self.device = device
        self._told = False  # that a closed step does not overlap, said once
        self.reset(open=False)

    def reset(self, open: bool) -> None:
        """Forget this step's accumulations. ``open``: hooks may launch buckets (``zero_grad()``
        opens a step, ``step()`` and construction leave it closed)."""
        self.open = open
        self.counts = [0] * len(self.layout.slots)
        self.pending = [len(b.params) for b in self.layout.buckets]
        self.launched = 0  # buckets [0, launched) are in flight or done
        self.works: list[object] = []
        self.staging_work: list[object] = [None] * len(self.staging)
        self.staged = 0
        self.done = False

    def on_grad(self, i: int) -> None:
        """Parameter ``i`` has just accumulated a gradient (called from its backward hook)."""
        if self.done or self.bucket_of[i] < self.launched:
            raise RuntimeError(
                f"parameter {self.names[i]!r} received a gradient after its bucket was reduced "
                f"for this step; with overlap, set backward_passes_per_step (now {self.passes}) "
                "to the number of backward passes per optimizer step, and do not run backward "
                "between grad_norm()/clip_grad_norm_() and step()"
            )
        self.counts[i] += 1
        if not self.overlap:
            return
        if self.counts[i] > self.passes:
            raise RuntimeError(
                f"parameter {self.names[i]!r} accumulated {self.counts[i]} gradients in one step, "
                f"more than backward_passes_per_step={self.passes}; raise it, or construct the "
                "optimizer with overlap=False"
            )
        if not self.open:
            if not self._told and self.ctx.dp_size > 1:
                log.info(
                    "ZeroOptimizer: gradients arrived before zero_grad() opened the step: their "
                    "reduction waits for step() (call zero_grad() before the backward to "
                    "overlap it)"
                )
                self._told = True
            return
        if self.counts[i] == self.passes:
            self.pending[self.bucket_of[i]] -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while (
            self.launched < len(buckets)
            and self.pending[self.launched] == 0
            and not buckets[self.launched].sequence_parallel  # summed over tp in finish()
        ):
            self._launch(self.launched)

    def _launch(self, b: int) -> None:
        if self.outputs[b] is None:  # nothing to reduce
            self.launched = b + 1
            return
        bucket = self.layout.buckets[b]
        grads = self.grad_buffers[bucket.buffer][bucket.start : bucket.end]  # (bucket,)
        k = None
        with comm.side_stream(self.stream):
            if bucket.sequence_parallel or grads.dtype != torch.float32:
                k = self.staged % len(self.staging)
                self.staged += 1
                comm.wait(self.staging_work[k])  # the previous user of this buffer is done
                stage = self.staging[k][: bucket.numel]
                stage.copy_(grads)  # fp32
                if bucket.sequence_parallel:
                    comm.all_reduce(stage, self.ctx.tp_group)  # partial over tp -> full
                grads = stage
            work = comm.reduce_scatter_into(
                self.outputs[b], grads, self.ctx.dp_group, async_op=True
            )
        if k is not None:
            self.staging_work[k] = work
        self.works.append(work)
        self.launched = b + 1

    def discard(self) -> None:
        """End an unfinished step without using its reduction (``zero_grad()`` in the middle of
        a step): launch every bucket not launched yet, as ``finish()`` would, and wait. The
        ranks may have launched different numbers of buckets, and a collective agreeing on how
        many would pair up with the ones in flight; launching all of them aligns every rank.
        Whether to do it rests on what every rank sees the same (the step is open, not
        finished, overlapping at dp >= 2), so a discarded step costs its collectives."""
        if self.done or not self.open or not self.overlap or self.ctx.dp_size == 1:
            return  # no rank launched anything that is still unmatched
        while self.launched < len(self.layout.buckets):
            self._launch(self.launched)
        for work in self.works:
            comm.wait(work)
        self.works = []

    def finish(self) -> None:
        """Launch every bucket not yet launched, in order, wait for all, average over dp
        (unless ``average`` is off)."""
        if self.done:
            return
        while self.launched < len(self.layout.buckets):
            self._launch(self.launched)
        for work in self.works:
            comm.wait(work)
        if self.average and self.ctx.dp_size > 1:
            for out in self.outputs:
                if out is not None:
                    out.div_(self.ctx.dp_size)
        self.works, self.done = [], True

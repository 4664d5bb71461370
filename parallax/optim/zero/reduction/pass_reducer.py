"""ZeRO-2 and 3 gradient reduction: every backward pass is reduce-scattered into this rank's shard.

**Accumulation over microbatches.** A step's gradients are the sum of several backward passes
(the microbatches of a pipeline schedule, times the accumulation steps). ZeRO-1 adds them up in
a full-size gradient buffer and reduce-scatters once. Here each pass is reduce-scattered on its
own and added into the rank's fp32 shard (``outputs[b]``, 4/dp bytes per parameter): a
parameter's gradient lives in full only from its arrival until its bucket's reduce-scatter,
in a pass buffer of that one bucket (fp32, freed once the collective is done), never in a
buffer the size of the model. The price is traffic: one reduce-scatter of the gradients per
pass instead of per step (``passes`` times ZeRO-1's). That is the right trade here: under a
pipeline the passes of one step arrive spread over the whole schedule (each microbatch's
backward separately), so a local full-size accumulator would live for the whole step, at
peak, and stage 2 would save nothing where memory is tightest; and at ZeRO-3 the full
gradient would cost as much as the weights that stage 3 shards.

**When a bucket goes out.** Which reduce-scatters a rank makes must not depend on its data: every
rank of the dp group must make the same ones in the same order. The unit of agreement is the *pass*
(one autograd graph task, e.g. one ``PipelineStage.backward``) and the *unit* of parameters
(:attr:`~parallax.optim.zero.buffers.packing.Bucket.unit`: a model chunk at ZeRO-2, a block at
ZeRO-3). A unit is *touched* in a pass when one of its parameters gets a gradient (or, at ZeRO-3,
the block's backward begins); at the end of the pass (a callback queued on the autograd engine by
the first touch, :func:`parallax.optim.zero.torch_contract.at_backward_end`) every bucket of every
touched unit that has not gone out yet is reduce-scattered, in layout order, with zeros for
parameters that got no gradient. Before that, ``ordered`` (ZeRO-2) launches a bucket from the
gradient hooks as soon as all its parameters have arrived and every earlier bucket of its unit has
gone out; at ZeRO-3 the block's post-backward hook launches its buckets
(:meth:`PassReducer.launch_unit`), in the autograd engine's order, the same on every rank that runs
the same graph. So each touched unit goes out exactly once per pass. The condition this rests on: in
a pass, a unit is touched on every dp rank or on none (a chunk at ZeRO-2 whose only trainable
parameters some ranks' data leave unused would break it).

With ``--offload optimizer`` an offloaded bucket (``sink.buckets``) has no shard on the device: each
pass's reduced chunk goes to ``sink`` (:class:`~parallax.optim.zero.offload.host_steps.HostSteps`),
which accumulates it in host memory and steps the bucket there once its last pass (``passes`` of
them) is in.

Buckets of ``sequence_parallel`` parameters (partial over tp) wait for the end of the pass and
are summed over tp on the current stream there, then reduced over dp like the others. On GPUs
the reduce-scatters and the additions into the shards run on a side stream (``stream``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from parallax import comm
from parallax.context import ParallelContext
from parallax.optim.zero.buffers.packing import FlatLayout
from parallax.optim.zero.torch_contract import at_backward_end

log = logging.getLogger(__name__)

IN_FLIGHT = 1  # reduce-scatters a pass leaves running before it waits for the oldest


class HostSink(Protocol):
    """Where the offloaded buckets' reduced chunks go, pass by pass
    (:class:`~parallax.optim.zero.offload.host_steps.HostSteps`)."""

    buckets: list[int]  # the offloaded buckets, in layout order
    hosted: frozenset[int]

    def arrive(self, b: int, grad: torch.Tensor, first: bool, last: bool) -> None: ...

    def complete(self, b: int, summed: bool) -> None: ...


class UnitListener(Protocol):
    """ZeRO-3's gathers (:class:`~parallax.optim.zero.weights.unit_gathers.UnitGathers`): they
    count each unit's gradients and end the units still active before a pass ends."""

    def on_grad(self, unit: int) -> None: ...

    def end_pass(self) -> None: ...


class PassReducer:
    """Each backward pass reduce-scattered into ``outputs`` (see the module docstring);
    ``ordered``: launch from the gradient hooks (ZeRO-2); ``sink``: the offloaded buckets' host
    steps; ``passes``: backward passes per step (offload steps a bucket after its last)."""

    def __init__(
        self,
        layout: FlatLayout,
        outputs: Sequence[torch.Tensor | None],
        names: Sequence[str],
        ctx: ParallelContext,
        *,
        ordered: bool,
        average: bool = True,
        stream: torch.cuda.Stream | None = None,
        device: torch.device | None = None,
        passes: int = 1,
        sink: HostSink | None = None,
    ) -> None:
        self.layout, self.outputs, self.names, self.ctx = layout, outputs, names, ctx
        self.ordered, self.average, self.stream = ordered, average, stream
        self.device = device or (outputs[0].device if outputs else torch.device("cpu"))
        self.passes, self.sink = passes, sink
        self.bucket_of = [slot.bucket for slot in layout.slots]
        self.of_unit: dict[int, list[int]] = {}
        for b in layout.buckets:
            self.of_unit.setdefault(b.unit, []).append(b.index)
        self.listener: UnitListener | None = None  # ZeRO-3's gathers, once they follow
        self.staging: list[torch.Tensor] = []  # nothing persistent beyond the shards
        self.live_bytes = self.peak_bytes = 0  # pass buffers and partial results alive
        self.late = 0  # passes that finish() had to end (gradients outside a backward pass)
        self._queued = False
        self.reset(open=False)

    # -- one pass --------------------------------------------------------------------------------
    def _start_pass(self) -> None:
        self.bufs: dict[int, torch.Tensor] = {}  # bucket -> its pass buffer (bucket,) fp32
        self.arrived = [0] * len(self.layout.buckets)
        self.got = [False] * len(self.layout.slots)
        self.sent = [False] * len(self.layout.buckets)  # reduce-scattered in this pass
        self.touched: set[int] = set()
        self.ready_from: dict[int, int] = {}  # unit -> its buckets before this one are sent

    def follow(self, listener: UnitListener) -> None:
        """Tell ``listener`` of each unit's gradients and of each pass's end, which it acts on
        first: ZeRO-3's gathers, which in turn touch units and launch them here."""
        self.listener = listener

    def touch(self, unit: int) -> None:
        """``unit`` takes part in this pass (see the module docstring); queues the pass's end."""
        self.touched.add(unit)
        if not self._queued and at_backward_end(self._end_of_backward):
            self._queued = True

    def take(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient of this pass (from its post-accumulate hook)."""
        b = self.bucket_of[i]
        bucket = self.layout.buckets[b]
        if self.sent[b] or self.done:
            raise RuntimeError(
                f"parameter {self.names[i]!r} received a gradient after its bucket was reduced "
                "for this backward pass (ZeRO-2/3 reduce each pass as it ends): a parameter "
                "must be used inside the forward of the block that holds it, and no backward "
                "may run between grad_norm()/clip_grad_norm_() and step()"
            )
        buf = self._buffer(b)
        slot = self.layout.slots[i]
        part = buf[slot.offset - bucket.start : slot.offset - bucket.start + slot.numel]
        if self.got[i]:
            part.add_(grad.reshape(-1))
        else:
            part.copy_(grad.reshape(-1))  # to fp32
            self.got[i] = True
            self.arrived[b] += 1
        self.touch(bucket.unit)
        if self.ordered:
            self._launch_ready(bucket.unit)
        elif self.listener is not None:
            self.listener.on_grad(bucket.unit)

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self.bufs.get(b)
        if buf is None:
            bucket = self.layout.buckets[b]
            buf = self.bufs[b] = torch.zeros(bucket.numel, device=self.device)  # (bucket,) fp32
            self._count(buf.numel() * 4)
        return buf

    def _count(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _launch_ready(self, unit: int) -> None:
        """Send the unit's buckets that are complete, in order, up to the first that is not.
        Called for every gradient: it resumes at the unit's first bucket not known to be sent
        (``ready_from``), so a pass costs O(buckets + parameters), not their product."""
        buckets, k = self.of_unit[unit], self.ready_from.get(unit, 0)
        while k < len(buckets):
            b = buckets[k]
            if not self.sent[b]:
                bucket = self.layout.buckets[b]
                if bucket.sequence_parallel or self.arrived[b] < len(bucket.params):
                    break  # held: the end of the pass sends it and every later one
                self._launch(b)
            k += 1
        self.ready_from[unit] = k  # every bucket of the unit before k has been sent

    def launch_unit(self, unit: int) -> None:
        """Reduce-scatter ``unit``'s buckets now (its backward is over: ZeRO-3's post-backward
        hook); sequence-parallel ones wait for the end of the pass."""
        if unit not in self.of_unit:
            return
        self.touch(unit)
        for b in self.of_unit[unit]:
            if not self.sent[b] and not self.layout.buckets[b].sequence_parallel:
                self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        buf = self._buffer(b)
        del self.bufs[b]
        if bucket.sequence_parallel:
            comm.all_reduce(buf, self.ctx.tp_group)  # partial over tp -> full, current stream
        out, tmp = self.outputs[b], None
        first = not self.summed[b]
        self.rounds[b] += 1
        sunk = self.sink is not None and b in self.sink.hosted
        if sunk and self.rounds[b] > self.passes:
            raise RuntimeError(
                f"bucket {b} was reduced in more backward passes than "
                f"backward_passes_per_step={self.passes}: with --offload optimizer its host step "
                "starts after the last one; set backward_passes_per_step to the passes per step"
            )
        with comm.side_stream(self.stream):
            if self.summed[b] or sunk:  # reduce aside, then add (or hand on)
                tmp = torch.empty(bucket.chunk, device=self.device)  # (bucket/dp,) fp32
                self._count(tmp.numel() * 4)
            work = comm.reduce_scatter_into(
                out if tmp is None else tmp, buf, self.ctx.dp_group, async_op=True
            )
        if self.stream is not None:
            buf.record_stream(self.stream)  # filled on the compute stream, read on the side
        self.summed[b] = self.sent[b] = True
        self.pending.append((work, tmp, buf, b, first, self.rounds[b] == self.passes))
        self._drain(keep=IN_FLIGHT)

    def _drain(self, keep: int = 0) -> None:
        """Wait for all but the ``keep`` newest reduce-scatters, add their results in, free."""
        with comm.side_stream(self.stream if self.pending[: -keep or None] else None):
            while len(self.pending) > keep:
                work, tmp, buf, b, first, last = self.pending.pop(0)
                comm.wait(work)
                if self.sink is not None and b in self.sink.hosted:
                    self.sink.arrive(b, tmp, first, last)
                elif tmp is not None:
                    self.outputs[b].add_(tmp)
                if tmp is not None:
                    self.live_bytes -= tmp.numel() * 4
                self.live_bytes -= buf.numel() * 4

    def _end_of_backward(self) -> None:
        self._queued = False
        self.end_pass()

    def end_pass(self) -> None:
        """Send every bucket of the units touched in this pass that has not gone out, in
        layout order, and wait for them (a pass's reduce-scatters never outlive it)."""
        if self.listener is not None:
            self.listener.end_pass()
        for unit in sorted(self.touched):
            for b in self.of_unit.get(unit, ()):
                if not self.sent[b]:
                    self._launch(b)
        self._drain()
        self._start_pass()

    # -- the step --------------------------------------------------------------------------------
    def reset(self, open: bool) -> None:
        """Forget this step's sums (``zero_grad()``, ``step()``)."""
        self.open = open
        self.summed = [False] * len(self.layout.buckets)  # the shard holds this step's sum
        self.rounds = [0] * len(self.layout.buckets)  # passes reduced this step
        self.pending: list[tuple] = []
        self.done = False
        self._start_pass()

    def discard(self) -> None:
        """End an unfinished step: every pass has completed its collectives already."""
        self._drain()

    def finish(self) -> None:
        """The step's reduction: buckets no pass reduced hold zeros, the rest the dp average
        (or the dp sum without ``average``)."""
        if self.done:
            return
        if self.touched:  # gradients that arrived outside an autograd pass
            self.late += 1
            self.end_pass()
        self._drain()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        sunk = self.sink.buckets if self.sink is not None else ()
        for b in sunk:  # offloaded buckets whose last pass did not come: complete now (in order)
            if self.rounds[b] != self.passes:
                self.sink.complete(b, self.summed[b])
        for b, out in enumerate(self.outputs):
            if b in sunk:
                continue
            if not self.summed[b]:
                out.zero_()
            elif self.average and self.ctx.dp_size > 1:
                out.div_(self.ctx.dp_size)
        self.done = True

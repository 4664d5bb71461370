"""``--offload optimizer``: this rank's fp32 masters and optimizer state in host memory, stepped
there bucket by bucket while the backward goes on.

At ZeRO-2 and 3 each backward pass reduce-scatters every bucket into an fp32 chunk
(:mod:`parallax.optim.zero.reduction.pass_reducer`). Offloaded, that chunk is added into the
bucket's accumulator in host memory (the model's dtype, pinned on GPUs) on the device, beside the
compute, without the host's cores (:mod:`parallax.optim.zero.offload.accumulators`); the last
pass also takes the sum's share of the gradient norm there, on the device, from the values the
host will hold (``--gpu-accumulation`` keeps some buckets' sums on the device instead:
:mod:`~parallax.optim.zero.offload.downloads`). When the bucket's last pass has landed, a worker
thread steps it on the bucket's host masters
(:mod:`~parallax.optim.zero.offload.bucket_steps`: torch's fused CPU AdamW on the sums made fp32,
or ``--host-adamw one-pass``) and in ``step()`` sends each bucket's updated weights up
(:mod:`~parallax.optim.zero.offload.uploads`), one bucket's copy beside the next one's step.

**The host's habits.** The worker runs on this process's share of the physical cores, kept on
them where it shares the host with other ranks or SMT siblings
(:func:`~parallax.optim.zero.offload.host_kernels.host_cpus`; torchrun sets
``OMP_NUM_THREADS=1``). Fused AdamW then runs at 112 GB/s (1.9 s for 7.5B parameters).

**When the host steps.** With ``step_in_backward`` (the Trainer sets it when nothing clips the
gradients) a bucket is stepped as soon as its gradient is complete, so the host's work hides
under the rest of the backward; the dp-global "got a gradient" flags of its parameters come from
one small all-reduce at its last reduce-scatter. Clipping needs the norm of the whole gradient
before any step: then only the copies, the accumulation and the norm run under the backward,
and the steps run in ``step()`` once ``clip_grad_norm_()`` has the coefficient. With
``step(defer=True)`` (:meth:`~parallax.optim.ZeroOptimizer.overlap_host_step`) they run on under
the next forward, which waits bucket by bucket (:meth:`HostSteps.wait_bucket`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.profiler import record_function

from parallax import comm
from parallax.context import ParallelContext
from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.offload.accumulators import Accumulators
from parallax.optim.zero.offload.bucket_steps import BucketSteps
from parallax.optim.zero.offload.host_kernels import host_cpus, keep_on
from parallax.optim.zero.offload.norm_part import local_part
from parallax.optim.zero.torch_contract import private_copy, refresh_copy


class HostSteps:
    """The host side of an offloaded ZeroOptimizer (see the module docstring): accumulators,
    staging, the worker thread and each bucket's step.

    ``flat``'s offloaded buckets are stepped with ``inner`` on ``device``'s host; each piece in
    its group (``piece_groups``) and, where ``counted``, in the norm (a tp-replicated piece on tp
    rank 0 only). ``early`` (``step_in_backward``): a bucket is stepped once its last pass is in,
    for the parameters that got a gradient on some dp rank (``has`` holds this rank's)."""

    def __init__(
        self,
        flat: FlatBuffers,
        inner: torch.optim.Optimizer,
        ctx: ParallelContext,
        device: torch.device,
        piece_groups: Sequence[int],
        counted: Sequence[bool],
        has: Sequence[bool],
        early: bool,
        kept: Sequence[int] = (),
        one_pass: bool = False,
    ) -> None:
        # the worker steps through its own handle on ``inner`` (same state, own group dicts): a
        # step left running under the next forward must not see the scheduler's next lr
        self.outer, self.inner = inner, private_copy(inner)
        self.flat, self.layout, self.device = flat, flat.layout, device
        self.early, self.has, self.dp, self.dp_group = early, has, ctx.dp_size, ctx.dp_group
        if early and flat.split:
            raise ValueError("split masters are stepped in step(), not during the backward")
        self.buckets = sorted(self.flat.offload)  # the offloaded ones, in the layout's order
        self.hosted = frozenset(self.buckets)
        self.counted = counted
        buckets = self.layout.buckets
        dtypes = {b: self.layout.dtypes[buckets[b].buffer] for b in self.buckets}
        self.on_device = device.type == "cuda"
        chunks = [bk.chunk for bk in buckets]
        self.sums = Accumulators(self.buckets, chunks, dtypes, device, kept)
        self.acc, self.flats = self.sums.acc, self.sums.flats  # (bucket/dp,) host views; buffers
        self.kept = self.sums.kept  # bucket -> its sum on the device (--gpu-accumulation)
        # how the worker steps a bucket and sends it up (torch's kernel or one pass)
        self.steps = BucketSteps(
            flat, self.inner, self.buckets, self.sums, piece_groups, self.dp, one_pass
        )
        self.up, self.down, self.one_pass = self.steps.up, self.steps.down, self.steps.one_pass
        self.worker = ThreadPoolExecutor(
            1, thread_name_prefix="parallax-offload", initializer=self._start_worker
        )
        # seconds spent since construction, by phase (worker: finish, step_later, upload and its
        # wait for staging; main thread: blocked on the worker): where a step's time goes
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.pending: dict[int, Future] = {}  # deferred: bucket -> its upload job
        self.reset()
        self.stale = True  # (the first use refreshes the worker's handle: a load may come first)

    def _start_worker(self) -> None:
        cpus, keep = host_cpus()
        torch.set_num_threads(len(cpus))
        if keep:
            keep_on(cpus)
        if self.on_device:
            torch.cuda.set_device(self.device)

    def end_step(self) -> None:
        """The step is over; the next use starts a new one (:meth:`_fresh`) after any of its
        work left running under the next forward."""
        self.stale = True

    def _fresh(self) -> None:
        if self.stale:
            self.wait()
            self.reset()

    def reset(self) -> None:
        """A new step: nothing in, nothing stepped (the worker idle)."""
        self.stale = False
        refresh_copy(self.inner, self.outer)
        self.jobs: list[Future] = []
        self.final = dict.fromkeys(self.buckets, False)
        self.steps.reset()
        # bucket -> its share of the squared 2-norm (a device scalar for a kept bucket)
        self.partials: dict[int, float | torch.Tensor] = {}
        self.coef: float | None = None

    def host_tensors(self) -> list[torch.Tensor]:
        return [*self.flats.values(), *self.steps.buffers()]

    # -- the main thread: what arrives from the reduction ------------------------------------------
    def arrive(self, b: int, grad: torch.Tensor, first: bool, last: bool) -> None:
        """Bucket ``b``'s reduced chunk of one pass (fp32, on the device, its reduction done on
        the current stream): added into its host accumulator on the device
        (:class:`~parallax.optim.zero.offload.accumulators.Accumulators`), the host's cores left
        free for the steps. The last pass also takes the sum's share of the gradient norm
        there, on the device, as the host will read it."""
        self._fresh()
        squares = self.sums.add(b, grad, first, self._pieces(b) if last else None)
        if last:
            self.partials[b] = squares  # (made on another stream: scaled once it is read)
            self.complete(b, summed=True)

    def complete(self, b: int, summed: bool) -> None:
        """Bucket ``b``'s gradient is all in (``summed``: some pass reduced it this step)."""
        self._fresh()
        if self.final[b]:
            return
        self.final[b] = True
        if not summed:  # no pass reduced it: a zero gradient (the host's zeroed by the worker)
            self.partials[b] = 0.0
            if b in self.kept:
                self.kept[b].zero_()
        if b in self.kept:  # the point its trip down waits for
            self.down.ready(b)
        landed = self.sums.landed()  # the worker reads the accumulator once its copies landed
        flags = None
        if self.early and summed:  # which of its parameters got a gradient on any dp rank
            has = [self.has[i] for i in self.layout.buckets[b].params]
            flags = torch.tensor(has, dtype=torch.float32).to(self.device)
            work = comm.all_reduce_async(flags, self.dp_group)
            flags = (flags, work)
        self._submit(self._finish, b, summed, flags, landed)

    def _submit(self, fn, *args) -> None:
        self.jobs.append(self.worker.submit(self._timed, fn, *args))

    def _timed(self, fn, *args) -> None:
        start, name = time.perf_counter(), fn.__name__.strip("_")
        try:
            with record_function(f"parallax.offload.{name}"):  # a profiler's host lane
                fn(*args)
        finally:
            self.seconds[name] += time.perf_counter() - start

    # -- the worker thread ------------------------------------------------------------------------
    def _pieces(self, b: int) -> list[slice]:
        """Where bucket ``b``'s pieces that count in the norm lie in its chunk."""
        pieces = self.flat.pieces
        return [
            slice(pieces[k].chunk_offset, pieces[k].chunk_offset + pieces[k].numel)
            for k in self.steps.pieces_of_bucket[b]
            if self.counted[k] and pieces[k].numel
        ]

    @torch.no_grad()
    def _finish(self, b: int, summed: bool, flags, landed) -> None:
        """Bucket ``b`` is complete: zeroed if no pass reduced it, stepped now when early (its
        norm was taken on the device)."""
        if landed is not None and b not in self.kept:
            landed.synchronize()
        if not summed and b not in self.kept:
            self.acc[b].zero_()
        if flags is not None:
            self._step_flagged(b, self.steps.gradient(b), flags)

    def _step_flagged(self, b: int, grad: torch.Tensor, flags) -> None:
        """Step bucket ``b`` during the backward, once its dp-global flags are in."""
        tensor, work = flags
        comm.wait(work)
        got = tensor.cpu().tolist()
        params = self.layout.buckets[b].params
        self.steps.step(b, grad, {i: bool(f) for i, f in zip(params, got)}, 1.0 / self.dp)

    @torch.no_grad()
    def _step_later(self, b: int, coef: float | None, flags) -> None:
        self.steps.step_later(b, coef, flags, self.seconds)

    def _upload(self, b: int) -> None:
        self.steps.upload(b, self.seconds)

    # -- the main thread: the step ---------------------------------------------------------------
    def wait(self) -> None:
        """Every job done (a worker's error is raised here) and, on GPUs, the current stream
        after every upload."""
        jobs, self.jobs = self.jobs, []
        start = time.perf_counter()
        with record_function("parallax.offload.wait"):
            for job in jobs:
                job.result()
        self.seconds["wait"] += time.perf_counter() - start
        self.up.arrived()
        self.pending.clear()

    def wait_bucket(self, b: int) -> None:
        """Bucket ``b``'s new weights in place (a deferred step's upload done; on GPUs the
        current stream after its copy): what the next forward waits for, bucket by bucket."""
        job = self.pending.pop(b, None)
        if job is None:
            return
        start = time.perf_counter()
        with record_function("parallax.offload.wait_bucket"):
            job.result()
        self.seconds["wait_bucket"] += time.perf_counter() - start
        self.up.arrived(b)

    def pending_uploads(self) -> dict[int, UploadWork]:
        """The deferred step's uploads still running, as handles the forward's hooks wait on."""
        return {b: UploadWork(self, b) for b in self.pending}

    def local_part(self, norm_type: float) -> float:
        """What this rank's offloaded gradients add to the global norm
        (:func:`~parallax.optim.zero.offload.norm_part.local_part`), once every job is done."""
        self._fresh()
        self.wait()
        return local_part(norm_type, self.partials, self.sums, self._pieces, self.dp)

    def clip(self, coef: torch.Tensor) -> None:
        self._fresh()
        if any(self.steps.stepped.values()):
            raise RuntimeError(
                "with --offload optimizer and step_in_backward the host steps each bucket during "
                "the backward: nothing may clip the gradients after it (grad clipping off)"
            )
        self.coef = float(coef) if self.coef is None else self.coef * float(coef)

    def step(self, flags: Sequence[bool], defer: bool = False) -> None:
        """Step every bucket not stepped yet (with the clip coefficient) and send each changed
        bucket's weights back; the current stream then waits for those uploads, or with
        ``defer`` returns at once: the next forward waits bucket by bucket
        (:meth:`wait_bucket`), anything else through :meth:`wait`."""
        self._fresh()
        self.wait()
        refresh_copy(self.inner, self.outer)  # (the worker is idle)
        self.up.start()
        for b in reversed(self.buckets):  # in the forward's order (the layout's is the backward's)
            self._submit(self._step_later, b, self.coef, flags)
            if any(flags[i] for i in self.layout.buckets[b].params):
                self._submit(self._upload, b)
                self.pending[b] = self.jobs[-1]
        if not defer:
            self.wait()


class UploadWork:
    """A deferred host step's upload of one bucket, as a handle the forward's hooks wait on
    (:meth:`HostSteps.wait_bucket`)."""

    def __init__(self, host: HostSteps, b: int) -> None:
        self.host, self.b = host, b

    def wait(self) -> None:
        self.host.wait_bucket(self.b)

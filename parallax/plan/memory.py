"""The memory model: what one rank holds on its GPU and on its host, for a run at a layout.

One code path for ``--dry-run`` and the planner. Per rank (the numbers of a pipeline rank; its
tp and dp peers hold as much):

- **weights**: every parameter of its blocks in its dtype (1/tp of the sharded ones); at ZeRO-3
  its 1/dp shard (frozen weights too: a LoRA base is sharded);
- **gradients**: ZeRO-1 keeps a gradient buffer in the parameters' dtype, plus (dp > 1, reduced
  during the backward) an fp32 slice of 4/dp bytes per 16-bit parameter; ZeRO-2/3 keep only the
  fp32 shard (4/dp bytes per trainable parameter; none when offloaded), each backward pass being
  reduce-scattered into it as it ends (:mod:`parallax.optim.zero.reduction.pass_reducer`);
- **optimizer**: AdamW's fp32 masters (4/dp per 16-bit parameter; fp32 parameters are their own)
  and moments (8/dp), on the host instead with ``--offload optimizer``;
- **gathered**: ZeRO-3's whole units at once: the one running and the one prefetched (two of
  the largest), or with ``--no-reshard-after-forward`` every unit of the stage until the step;
- **activations** (:mod:`parallax.plan.activations`): what the blocks keep for the backward
  (:meth:`Recipe.block_estimates`: checkpointed blocks keep their input), times the
  micro-batch, at the schedule's peak of microbatches in flight per stage
  (:func:`parallax.pipeline.simulate.peak_activations`, per stage for interleaved schedules),
  with the tensors a stage receives and sends;
- **workspace**: the backward's transient: the gradients in flight in one piece's backward
  (a recomputed piece's saved tensors again first), less what the pieces after it have freed;
- **buffers**: ZeRO's fp32 staging and per-pass buffers, about a bucket each;
- **host**: with offload the fp32 masters, moments and the gradient accumulator in the model's
  dtype (2/dp bytes per parameter), one bucket's fp32 scratch and, on GPUs, the uploads' pinned
  staging (one pass of weights up to 512 MiB).

Weights, gradients, optimizer and host are the stage's own terms per element
(:meth:`parallax.optim.zero.stage.ZeroStage.trainable_bytes`), over the buckets the optimizer
would pack (:func:`parallax.optim.zero.buffers.packing.bucket_numels`) and the share of them it
would offload (:func:`parallax.optim.zero.offload.share.offloaded_share`): the optimizer's rules,
not a copy of them.

What a card needs beyond the peak allocation: the caching allocator's reserve and the CUDA
context (:meth:`RankMemory.needed`, from the machine profile).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.optim.zero.buffers.packing import DEFAULT_BUCKET_NUMEL, bucket_numels
from parallax.optim.zero.offload.share import offloaded_share
from parallax.optim.zero.stage import (
    HOST_FLOOR_BYTES,
    ElementBytes,
    ZeroStage,
    stage_of,
)
from parallax.plan.activations import activation_bytes
from parallax.plan.host_memory import PINNED, kept_on_gpu, offload_host
from parallax.plan.layout import Layout
from parallax.plan.machine import Machine
from parallax.plan.workload import Workload

GIB = 2**30
PASS_BUFFERS = 2  # ZeRO-2/3 pass buffers alive at once: one in flight, one filling
HOST_PER_PROCESS = 3.0 * GIB  # a torch + CUDA training process's own resident memory


@dataclass(frozen=True)
class RankMemory:
    """Bytes of one pipeline rank (see the module docstring) and what it holds."""

    pp_rank: int
    blocks: tuple[str, ...]
    params: int
    trainable: int
    adapters: int
    groups: tuple[int, ...]
    units: int  # ZeRO-3 units (each gathered on its own)
    weights: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    workspace: float
    buffers: float
    host: float
    pinned: float = 0.0  # of the host bytes, offload's pinned staging (made on GPUs only)
    building: float = 0.0  # while the optimizer is made: the model as built and its flat copy
    quantized: float = 0.0  # of the weights, the base's linears held quantized (--quantize-base)
    host_parts: tuple[tuple[str, float], ...] = ()  # the host bytes by what they hold
    offloaded: float = 0.0  # trainable elements whose optimizer this rank steps on the host
    kept: float = 0.0  # of those, the elements whose gradients are summed on the GPU

    @property
    def host_floor(self) -> float:
        """The least the offloaded elements need on the host: fp32 masters and AdamW's moments
        (:data:`~parallax.optim.zero.stage.HOST_FLOOR_BYTES` a parameter)."""
        return self.offloaded * HOST_FLOOR_BYTES

    @property
    def host_ratio(self) -> float | None:
        """The offload's host bytes over that floor; ``None`` without offload."""
        return self.host / self.host_floor if self.offloaded else None

    @property
    def gpu(self) -> float:
        """The peak of allocated GPU bytes (what ``torch.cuda.max_memory_allocated`` reads):
        training's, or the optimizer's construction where that is higher."""
        return max(self.building, self.training)

    @property
    def training(self) -> float:
        """Allocated GPU bytes at training's peak."""
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.gathered
            + self.activations
            + self.workspace
            + self.buffers
        )

    def needed(self, machine: Machine) -> float:
        """GPU bytes the card must have: the peak, the allocator's reserve, the CUDA context."""
        return self.gpu * (1 + machine.allocator_reserve) + machine.cuda_context_gib * GIB

    def capped(self, machine: Machine) -> float:
        """What ``--gpu-memory-limit`` must allow (the cap leaves out the CUDA context)."""
        return self.gpu * (1 + machine.allocator_reserve)


@dataclass(frozen=True)
class _Counts:
    """Padded elements of one rank's blocks: trainable and frozen by element size."""

    t2: int
    t4: int
    f2: int
    f4: int
    largest: int  # largest trainable parameter
    unit: int  # bytes of the largest ZeRO-3 unit
    partial: int  # trainable elements whose gradient is partial over tp (buckets of their own)
    buckets: dict  # (element size, partial over tp) -> its largest ZeRO-1/2 bucket's elements
    order: list  # every bucket's (key, elements), in the order they are reduced
    quantized: int = 0  # bytes of frozen weights held quantized: whole on every dp rank

    @property
    def trainable(self) -> int:
        return self.t2 + self.t4

    @property
    def full_bytes(self) -> int:
        return 2 * (self.t2 + self.f2) + 4 * (self.t4 + self.f4)


def rank_memory(model: Workload, layout: Layout, pp_rank: int, overlap: bool = True) -> RankMemory:
    """What pipeline rank ``pp_rank`` holds at ``layout`` (``overlap``: ZeRO-1 reduces during
    the backward, ``--overlap-grad-reduce``)."""
    held = _held(model, layout, pp_rank)
    c = held.counts
    # a clipped one-pass step reads the host's sums in place and sends them up from there: only
    # sums kept on the GPU come down into an fp32 scratch and go up through the ring
    apart = not model.run.host_step_one_pass or layout.accumulate > 0
    split = model.run.host_masters_split  # (16-bit masters as low halves on the host)
    # ZeRO's terms read only these: the same at every micro-batch size, schedule and recompute
    zero = (layout.dp, layout.zero, layout.offload, layout.reshard_after_forward, overlap, apart)
    zero += (split,)
    key = ("states", layout.tp, layout.pp, layout.chunks, pp_rank, *zero)
    if key not in model.cache:
        model.cache[key] = _states(c, *zero)
    weights, gradients, optimizer, gathered, buffers, hosted, share = model.cache[key]
    # sums on the GPU, not the host
    kept, kept_bytes, hosted = kept_on_gpu(c.order, layout, hosted)
    gradients += kept_bytes
    activations, workspace = activation_bytes(model, layout, pp_rank)
    return RankMemory(
        pp_rank=pp_rank,
        blocks=held.blocks,
        params=held.params,
        trainable=held.trainable,
        adapters=held.adapters,
        groups=held.groups,
        units=held.units,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        gathered=gathered,
        activations=activations,
        workspace=workspace,
        buffers=buffers,
        host=sum(hosted.values()),
        pinned=hosted.get(PINNED, 0.0),
        building=_building(c, layout),
        quantized=float(c.quantized),
        host_parts=tuple(hosted.items()),
        offloaded=share * c.trainable / layout.dp,
        kept=kept,
    )


@dataclass(frozen=True)
class _Held:
    """What a pipeline rank's blocks hold at a tp, whatever the rest of the layout."""

    blocks: tuple[str, ...]
    params: int
    trainable: int
    adapters: int
    groups: tuple[int, ...]
    units: int
    counts: _Counts


def _held(model: Workload, layout: Layout, pp_rank: int) -> _Held:
    key = ("held", layout.tp, layout.pp, layout.chunks, pp_rank)
    if key not in model.cache:
        ranges = model.ranges(layout.pp, layout.chunks)
        mine = [i for s in model.stages_of(layout, pp_rank) for i in ranges[s]]
        params = [model.params(layout.tp)[i] for i in mine]
        model.cache[key] = _Held(
            blocks=tuple(model.blocks[i].name for i in mine),
            params=sum(b.params for b in params),
            trainable=sum(b.trainable_params for b in params),
            adapters=sum(b.adapters for b in params),
            groups=tuple(sum(vals) for vals in zip(*(b.groups for b in params))),
            units=sum(len(b.units) for b in params),
            counts=_counts(params),
        )
    return model.cache[key]  # type: ignore[return-value]


def _counts(blocks) -> _Counts:
    def total(attr: str, size: int) -> int:
        return sum(n for b in blocks for s, n in getattr(b, attr) if s == size)

    # ZeRO's buckets at its default size, without the padding to dp (these counts are per tp)
    order = bucket_numels([s for b in blocks for s in b.sizes], 1, DEFAULT_BUCKET_NUMEL)
    largest: dict[tuple[int, bool], int] = {}
    for key, n in order:
        largest[key] = max(largest.get(key, 0), n)
    return _Counts(
        t2=total("trainable", 2),
        t4=total("trainable", 4),
        f2=total("frozen", 2),
        f4=total("frozen", 4),
        largest=max((b.largest for b in blocks), default=0),
        unit=max((u for b in blocks for u in b.units), default=0),
        partial=sum(b.partial for b in blocks),
        buckets=largest,
        order=order,
        quantized=sum(b.quantized for b in blocks),
    )


def _states(
    c: _Counts,
    dp: int,
    zero: int,
    offload: float,
    reshard: bool,
    overlap: bool,
    apart: bool,
    split: bool,
) -> tuple:
    """(weights, gradients, optimizer, gathered, buffers, host bytes by what they hold, share
    offloaded) of ZeRO ``zero`` at ``dp`` (the host's: :mod:`parallax.plan.host_memory`;
    ``reshard``: stage 3 frees gathered weights after the forward; ``apart``: some bucket steps
    from a scratch and goes up through the ring; ``split``: ``--host-masters split``)."""
    stage = stage_of(zero)
    share = offloaded_share([n for _, n in c.order], float(offload))  # whole buckets
    held = _element_bytes(c, stage, dp, overlap, share)
    sixteen = c.buckets.get((2, False), 0)  # the largest bucket of 16-bit weights
    partial = max((n for (_, p), n in c.buckets.items() if p), default=0)
    bucket = max(c.buckets.values(), default=0)
    gathered = 0.0
    if stage.shards_weights:  # a bucket never spans two units
        bucket = min(bucket, c.unit // (2 if c.t2 else 4))
        if dp > 1:
            gathered = 2.0 * c.unit if reshard else float(c.full_bytes)
    if stage.reduces_each_pass:
        # pass buffers: the bucket filling, the one in flight, its reduced part
        buffers = 4.0 * min(PASS_BUFFERS * bucket, c.trainable) + 4.0 * bucket / dp
    else:
        # fp32 staging: two buffers for the reduction of 16-bit buckets (dp > 1) and of those
        # partial over tp; one for dp = 1's step of 16-bit buckets
        reduced = max(sixteen if dp > 1 else 0, partial)
        buffers = 2 * 4.0 * reduced + (4.0 * sixteen if dp == 1 else 0.0)
    hosted = offload_host(stage, dp, share, c.t2, c.t4, bucket, apart, split)
    weights = held.weights + c.quantized
    return weights, held.gradients, held.optimizer, gathered, buffers, hosted, share


def _element_bytes(
    c: _Counts, stage: ZeroStage, dp: int, overlap: bool, share: float
) -> ElementBytes:
    """What the rank's elements cost by the stage's terms: the trainable ones by element size,
    ``share`` of them offloaded, and the frozen ones."""
    total = ElementBytes()
    for size, trainable, frozen in ((2, c.t2, c.f2), (4, c.t4, c.f4)):
        kept = stage.trainable_bytes(dp, size, overlap=overlap)
        if share:
            moved = stage.trainable_bytes(dp, size, overlap=overlap, offloaded=True)
            kept = kept * (1 - share) + moved * share
        total = total + kept * trainable + stage.frozen_bytes(dp, size) * frozen
    return total


def _building(c: _Counts, layout: Layout) -> float:
    """GPU bytes while the optimizer is made: ZeRO-1/2 allocate the flat buffers of the
    trainable weights whole while the model's own copies still exist; ZeRO-3 moves the weights
    into their buckets one bucket at a time
    (:class:`parallax.optim.zero.weights.shards.ShardedStore`)."""
    if stage_of(layout.zero).shards_weights:
        return float(c.full_bytes) + float(min(c.unit, c.full_bytes))
    return float(c.full_bytes) + 2.0 * c.t2 + 4.0 * c.t4


def plan_memory(model: Workload, layout: Layout, overlap: bool = True) -> list[RankMemory]:
    """Every pipeline rank's memory at ``layout``."""
    return [rank_memory(model, layout, p, overlap) for p in range(layout.pp)]


def node_host_bytes(ranks: list[RankMemory], layout: Layout, gpus_per_node: int) -> float:
    """Host bytes of one node: its training processes (the most a rank needs, times the ranks
    a node holds) and each process's own resident memory."""
    per_node = min(gpus_per_node, layout.world)
    return per_node * (max(r.host for r in ranks) + HOST_PER_PROCESS)

"""Where every trainable parameter lives in the flat buffers, and which part each dp rank owns.

Pure arithmetic, no tensors and no processes: every dp rank computes the same layout from the
same parameter shapes, which is what lets them make identical collectives in an identical order.

Parameters are packed into one flat buffer per dtype, in reverse order (the order in which the
backward pass tends to finish them), and the buffer is cut into buckets of about
``bucket_numel`` elements. A parameter never straddles two buckets. Each bucket is padded to a
multiple of ``dp * ALIGN`` elements and split into ``dp`` equal chunks: dp rank ``r`` owns chunk
``r`` of every bucket, so one reduce-scatter and one all-gather per bucket move exactly the
owned parts, and the slices are balanced to within the padding. Parameters whose gradient is
partial over tp (``sequence_parallel``) get buckets of their own, reduced last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # elements: every parameter and every chunk starts on a 32/64-byte boundary


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Slot:
    """One parameter's place: ``buffer[offset : offset + numel]`` of flat buffer ``buffer``."""

    buffer: int
    offset: int
    numel: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A padded range ``[start, end)`` of one flat buffer, reduced and gathered as one message."""

    index: int  # position in the launch order
    buffer: int
    start: int
    end: int
    params: tuple[int, ...]
    sequence_parallel: bool
    dp: int
    unit: int = 0  # the group of parameters it belongs to (a block at ZeRO-3, a chunk at 2)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk(self) -> int:
        """Elements owned by each dp rank."""
        return self.numel // self.dp

    def chunk_start(self, dp_rank: int) -> int:
        """Start of dp rank ``dp_rank``'s chunk in the flat buffer."""
        return self.start + dp_rank * self.chunk


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` (flattened, ``[start, start + numel)``) that a rank owns;
    it sits at ``chunk_offset`` inside that rank's chunk of bucket ``bucket``."""

    param: int
    start: int
    numel: int
    bucket: int
    chunk_offset: int


@dataclass(frozen=True)
class FlatLayout:
    dtypes: tuple[torch.dtype, ...]  # flat buffer i holds parameters of dtypes[i]
    sizes: tuple[int, ...]  # elements of flat buffer i, padding included
    slots: tuple[Slot, ...]  # per parameter, in the optimizer's parameter order
    buckets: tuple[Bucket, ...]  # in launch order: every rank reduces them in this order
    dp: int

    def pieces(self, dp_rank: int) -> list[Piece]:
        """What dp rank ``dp_rank`` owns, bucket by bucket (padding is owned by nobody)."""
        out = []
        for bucket in self.buckets:
            lo = bucket.chunk_start(dp_rank)
            hi = lo + bucket.chunk
            for i in bucket.params:
                slot = self.slots[i]
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    out.append(Piece(i, a - slot.offset, b - a, bucket.index, a - lo))
        return out


class _Packer:
    """Buckets being filled, one open bucket per (buffer, sequence-parallel) key."""

    def __init__(self, shapes, dtypes, sequence_parallel, dp: int, bucket_numel: int) -> None:
        self.shapes, self.dtypes, self.sp = shapes, dtypes, sequence_parallel
        self.dp, self.bucket_numel = dp, bucket_numel
        self.buffer_dtypes = tuple(dict.fromkeys(dtypes))  # first-seen order
        self.sizes = [0] * len(self.buffer_dtypes)
        self.slots: dict[int, Slot] = {}
        self.buckets: list[Bucket] = []
        self.open: dict[tuple[int, bool], list[int]] = {}  # key -> params of the open bucket
        self.filled: dict[tuple[int, bool], int] = {}  # key -> elements in the open bucket
        self.unit = 0

    def close(self, key: tuple[int, bool]) -> None:
        members = self.open.pop(key, [])
        self.filled.pop(key, None)
        if not members:
            return
        buf, sp = key
        start = offset = self.sizes[buf]
        for i in members:
            numel = _numel(self.shapes[i])
            self.slots[i] = Slot(buf, offset, numel, len(self.buckets))
            offset += _round_up(numel, ALIGN)
        end = start + _round_up(offset - start, self.dp * ALIGN)
        self.sizes[buf] = end
        index = len(self.buckets)
        self.buckets.append(
            Bucket(index, buf, start, end, tuple(members), sp, self.dp, unit=self.unit)
        )

    def fill(self, i: int) -> None:
        key = (self.buffer_dtypes.index(self.dtypes[i]), bool(self.sp[i]))
        self.open.setdefault(key, []).append(i)
        self.filled[key] = self.filled.get(key, 0) + _round_up(_numel(self.shapes[i]), ALIGN)
        if self.filled[key] >= self.bucket_numel:
            self.close(key)

    def close_all(self, sequence_parallel: bool | None = None) -> None:
        """Close the open buckets (only those of one kind when ``sequence_parallel`` is given)."""
        for key in sorted(self.open):
            if sequence_parallel is None or key[1] == sequence_parallel:
                self.close(key)

    def layout(self) -> FlatLayout:
        slots = tuple(self.slots[i] for i in range(len(self.shapes)))
        return FlatLayout(
            self.buffer_dtypes, tuple(self.sizes), slots, tuple(self.buckets), self.dp
        )


def build_layout(
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    sequence_parallel: Sequence[bool],
    dp: int,
    bucket_numel: int,
    order: Sequence[int] | None = None,
    units: Sequence[int] | None = None,
) -> FlatLayout:
    """Pack parameters (given by shape, dtype and sequence-parallel flag) into buckets.

    ``order`` lists the parameter indices in the order the forward pass uses them (default:
    as given); they are packed and reduced from its end. ``units`` (a unit per parameter, each
    unit's parameters contiguous in ``order``): no bucket holds two units, and each unit's
    sequence-parallel buckets follow its others (ZeRO-2 and 3 reduce unit by unit).
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    order = list(range(len(shapes)) if order is None else order)[::-1]  # backward: last first
    if sorted(order) != list(range(len(shapes))):
        raise ValueError("order must be a permutation of the parameter indices")
    packer = _Packer(shapes, dtypes, sequence_parallel, dp, bucket_numel)
    for unit, members in _unit_runs(order, units):
        packer.unit = unit
        for i in members:
            if not sequence_parallel[i]:
                packer.fill(i)
        packer.close_all(sequence_parallel=False)
        for i in members:  # partial-over-tp gradients: their own buckets, reduced last
            if sequence_parallel[i]:
                packer.fill(i)
        packer.close_all()
    return packer.layout()


def _unit_runs(order: list[int], units: Sequence[int] | None) -> list[tuple[int, list[int]]]:
    """``order`` cut where the unit changes; every unit must be one run."""
    if units is None:
        return [(0, order)]
    runs: list[tuple[int, list[int]]] = []
    for i in order:
        if runs and runs[-1][0] == units[i]:
            runs[-1][1].append(i)
        else:
            runs.append((units[i], [i]))
    if len({u for u, _ in runs}) != len(runs):
        raise ValueError("each unit's parameters must be contiguous in the order")
    return runs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# Where a bucket's fp32 reduced gradient (this rank's chunk) lives between the reduction and
# the optimizer step. The choice is static, the same on every rank.
OWN = "own"  # fp32 gradients: the rank's own chunk of the gradient buffer, reduced in place
SHARD = "shard"  # a persistent fp32 slice: the reduction may finish during backward (overlap)
INPLACE = "inplace"  # fp32 over the bucket's own 16-bit gradient bytes, reduced inside step()
STAGED = "staged"  # dp=1: made in a reused buffer right before the bucket is stepped
HOMES = (OWN, SHARD, INPLACE, STAGED)


def grad_homes(layout: FlatLayout, overlap: bool, stage: int = 1) -> list[str]:
    """The cheapest correct home of each bucket's fp32 reduced gradient.

    At ZeRO-2 and 3 there is no full gradient buffer: every bucket accumulates its reduced
    gradient in a persistent fp32 slice (4/dp bytes per parameter), whatever its dtype.
    fp32 buckets are reduced in place. Otherwise, at dp=1 there is nothing to reduce (only the
    tp sum of sequence-parallel buckets, which are small and keep a slice): the fp32 gradient
    is made in a reused staging buffer when the optimizer steps the bucket. At dp >= 2, a
    bucket reduced inside ``step()`` (overlap off, or sequence-parallel buckets, which always
    wait for ``step()``) writes its fp32 chunk over its own gradient bytes, which hold
    ``dp * itemsize >= 4`` bytes per chunk element and are dead once copied into the fp32
    staging buffer; a bucket that overlap may reduce during backward keeps a persistent slice.
    """
    if stage >= 2:
        return [SHARD] * len(layout.buckets)
    homes = []
    for b in layout.buckets:
        dtype = layout.dtypes[b.buffer]
        if dtype == torch.float32:
            homes.append(OWN)
        elif layout.dp == 1:
            homes.append(SHARD if b.sequence_parallel else STAGED)
        elif (b.sequence_parallel or not overlap) and layout.dp * dtype.itemsize >= 4:
            homes.append(INPLACE)
        else:
            homes.append(SHARD)
    return homes


def check_homes(layout: FlatLayout, homes: Sequence[str], stage: int = 1) -> None:
    """Reject homes that cannot hold a bucket's reduced gradient (an internal consistency
    check: :func:`grad_homes` never makes them)."""
    if len(homes) != len(layout.buckets):
        raise ValueError(f"{len(homes)} gradient homes for {len(layout.buckets)} buckets")
    if stage >= 2:
        if any(home != SHARD for home in homes):
            raise ValueError(f"ZeRO-{stage} keeps every bucket's gradient in a {SHARD!r} slice")
        return
    for b, home in zip(layout.buckets, homes):
        fp32 = layout.dtypes[b.buffer] == torch.float32
        bad = (
            home not in HOMES
            or (home == OWN and not fp32)  # only fp32 gradients are their own fp32 home
            or (fp32 and home not in (OWN, STAGED))
            or (home == INPLACE and layout.dp * layout.dtypes[b.buffer].itemsize < 4)
            or (home == STAGED and (layout.dp != 1 or b.sequence_parallel))
        )
        if bad:
            raise ValueError(
                f"bucket {b.index} ({layout.dtypes[b.buffer]}, dp={layout.dp}, "
                f"sequence_parallel={b.sequence_parallel}) cannot keep its gradient {home!r}"
            )

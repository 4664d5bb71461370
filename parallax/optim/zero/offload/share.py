"""Which buckets ``--offload-fraction`` puts on the host, and which of those ``--gpu-accumulation``
sums on the device, from the buckets' sizes alone: the optimizer offloads them and the planner
(:mod:`parallax.plan.memory`) counts their shares."""

from __future__ import annotations

from collections.abc import Sequence

from parallax.optim.zero.buffers.master_halves import can_split


def offloaded_buckets(numels: Sequence[int], fraction: float) -> list[int]:
    """The buckets to offload (positions in ``numels``, each bucket's elements in layout
    order): the first ones reduced, the last layers, whose host steps have the most backward
    left to hide under, up to ``fraction`` of the elements and at least one when ``fraction``
    > 0."""
    if fraction <= 0:
        return []
    total, out, held = sum(numels), [], 0
    for b, n in enumerate(numels):
        if out and held + n > fraction * total + 0.5:
            break
        out.append(b)
        held += n
    return out


def offloaded_share(numels: Sequence[int], fraction: float) -> float:
    """The share of the elements that :func:`offloaded_buckets` puts on the host."""
    chosen = offloaded_buckets(numels, fraction)
    return sum(numels[b] for b in chosen) / sum(numels) if chosen else 0.0


def kept_buckets(numels: Sequence[int], hosted: Sequence[int], fraction: float) -> list[int]:
    """Of the offloaded buckets ``hosted``, those whose gradients are summed on the device
    (``--gpu-accumulation``): the last ones in layout order, the first layers (the offloaded ones
    are the last layers first: a partial offload keeps the first layers' optimizer on the device
    and this keeps their neighbours' sums there), up to ``fraction`` of the offloaded
    elements."""
    if fraction <= 0 or not hosted:
        return []
    total, out, held = sum(numels[b] for b in hosted), [], 0
    for b in reversed(sorted(hosted)):
        if held + numels[b] > fraction * total + 0.5:
            break
        out.append(b)
        held += numels[b]
    return sorted(out)


def split_buckets(dtypes: Sequence, hosted: Sequence[int]) -> list[int]:
    """Of the offloaded buckets ``hosted``, those whose masters ``--host-masters split`` keeps
    as low halves: the bf16 ones (``dtypes``: each bucket's; a bf16 weight is the top half of
    its fp32 master, an fp16 or fp32 one is not)."""
    return [b for b in hosted if can_split(dtypes[b])]

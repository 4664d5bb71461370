"""Which buckets ``--offload-fraction`` puts on the host, from the buckets' sizes alone: the
optimizer offloads them and the planner (:mod:`parallax.plan.memory`) counts their share."""

from __future__ import annotations

from collections.abc import Sequence


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

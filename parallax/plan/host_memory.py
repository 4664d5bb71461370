"""The host side of an offloaded rank, as the optimizer holds it: the stage's host terms (fp32
masters, moments and the passes' sums), the worker's scratch, the pinned staging, and the sums
``--gpu-accumulation`` keeps on the GPU instead (:mod:`parallax.optim.zero.offload`: the same
rules, imported, not copied)."""

from __future__ import annotations

from collections.abc import Sequence

from parallax.optim.zero.offload.share import kept_buckets, offloaded_buckets
from parallax.optim.zero.offload.upload_ring import STAGING_BYTES
from parallax.optim.zero.stage import ACCUMULATION, ZeroStage
from parallax.plan.layout import Layout

SCRATCH, PINNED = "step scratch", "pinned staging"  # host bytes beside the stage's terms: the
# step's fp32 gradient, and the page-locked buffers of the copies up and down


def offload_host(
    stage: ZeroStage,
    dp: int,
    share: float,
    t2: int,
    t4: int,
    bucket: int,
    apart: bool = True,
    split: bool = False,
) -> dict[str, float]:
    """Host bytes by what they hold for ``share`` of ``t2`` 16-bit and ``t4`` 32-bit trainable
    elements offloaded at ``dp`` (``bucket``: the largest bucket's elements; :data:`PINNED`: the
    staging, which only a run on GPUs makes; without ``apart``, a one-pass step that writes the
    weights over the sums, neither it nor the scratch; ``split``: ``--host-masters split``, the
    16-bit elements' masters as low halves and two landing buffers for the weights)."""
    hosted: dict[str, float] = {}
    if not share:
        return hosted
    for size, n in ((2, t2), (4, t4)):
        for name, each in stage.host_parts(dp, size, split=split).items():
            hosted[name] = hosted.get(name, 0.0) + each * share * n
    if split and t2:
        hosted[PINNED] = 2 * 2.0 * bucket / dp  # the weights coming down, two buckets
    if not apart:
        return hosted
    width = 2 if t2 else 4
    staged = share * (2.0 * t2 + 4.0 * t4) / dp  # one pass of offloaded gradients
    hosted[SCRATCH] = 4.0 * bucket / dp  # the fp32 gradient of the bucket being stepped
    ring = max(min(staged, STAGING_BYTES), width * bucket / dp)
    hosted[PINNED] = hosted.get(PINNED, 0.0) + ring
    return hosted


def kept_on_gpu(
    order: Sequence, layout: Layout, hosted: dict[str, float]
) -> tuple[float, float, dict[str, float]]:
    """``(elements, device bytes, host parts)`` of the offloaded gradients this rank sums on the
    GPU (``--gpu-accumulation``: whole buckets, the optimizer's own choice, ``order`` the
    buckets' ``((element size, partial), elements)``): ``hosted`` without their sums and with
    their two pinned landing buffers (a new dict; ``hosted`` is left as it is)."""
    if not (layout.offload and layout.accumulate):
        return 0.0, 0.0, hosted
    numels = [n for _, n in order]
    chosen = kept_buckets(
        numels, offloaded_buckets(numels, float(layout.offload)), layout.accumulate
    )
    if not chosen:
        return 0.0, 0.0, hosted
    dp = layout.dp
    sizes = {b: order[b][0][0] * numels[b] / dp for b in chosen}  # bytes of each sum
    device = sum(sizes.values())
    hosted = dict(hosted)
    hosted[ACCUMULATION] = max(0.0, hosted.get(ACCUMULATION, 0.0) - device)
    hosted[PINNED] = hosted.get(PINNED, 0.0) + 2.0 * max(sizes.values())  # one each way
    return sum(numels[b] for b in chosen) / dp, device, hosted

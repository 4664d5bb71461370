"""ZeRO-2's ordered launches (:class:`parallax.optim.zero.reduction.pass_reducer.PassReducer`),
single process: a bucket goes out as soon as its gradients are all in and every earlier bucket of
its unit has gone out, whatever order the gradients arrive in, and each pass sends every bucket
once."""

import random

import pytest
import torch

from parallax.context import ParallelContext
from parallax.optim.zero.buffers.packing import build_layout
from parallax.optim.zero.reduction.pass_reducer import PassReducer


def _expected(layout, arrived: set[int], sent: list[int]) -> list[int]:
    """The reference rule, scanned from the start of each unit: a prefix of complete buckets."""
    out = list(sent)
    for unit in sorted({b.unit for b in layout.buckets}):
        for b in (b for b in layout.buckets if b.unit == unit):
            if b.index in out:
                continue
            if not set(b.params) <= arrived:
                break
            out.append(b.index)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ordered_launches_follow_the_prefix_rule(seed):
    n = 40
    units = [i // 10 for i in range(n)]  # four units of ten parameters
    layout = build_layout([(16,)] * n, [torch.float32] * n, [False] * n, 1, 32, units=units)
    outs = [torch.zeros(b.chunk) for b in layout.buckets]
    ctx = ParallelContext.local(device=torch.device("cpu"))
    reducer = PassReducer(layout, outs, [f"p{i}" for i in range(n)], ctx, ordered=True)
    reducer.passes = 2
    launched: list[int] = []
    launch = reducer._launch
    reducer._launch = lambda b: (launched.append(b), launch(b))[-1]
    rng = random.Random(seed)
    grads = [torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    for _ in range(2):  # two passes: the rule restarts with each
        launched.clear()
        order = list(range(n))
        rng.shuffle(order)
        for k, i in enumerate(order):
            before = list(launched)
            reducer.take(i, grads[i])
            assert launched == _expected(layout, set(order[: k + 1]), before)
        assert len(launched) == len(layout.buckets)  # every bucket went out in the pass
        reducer.end_pass()
    reducer.finish()
    for b, out in zip(layout.buckets, outs):  # each parameter's two passes, summed
        for i in b.params:
            slot = layout.slots[i]
            lo = slot.offset - b.start
            assert torch.equal(out[lo : lo + 16], 2 * grads[i])

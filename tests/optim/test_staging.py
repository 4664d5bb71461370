"""The offload's staging ring: pieces handed out first in, first out, never overlapping a live
piece, waiting (not failing) while the ring is full."""

import random
import threading
import time

import pytest
import torch

from parallax.optim.zero.offload import upload_ring as staging
from parallax.plan import host_memory as plan_memory


def test_pieces_wrap_around_and_wait_for_the_oldest():
    ring = staging.Ring(10, torch.float32, pin=False)
    a, ta = ring.take(4)
    b, tb = ring.take(4)
    assert (ta[0], tb[0]) == (0, 4)
    got = {}
    taker = threading.Thread(target=lambda: got.update(piece=ring.take(3)))
    taker.start()
    time.sleep(0.2)
    assert taker.is_alive()  # 8 + 3 > 10 and [0, 4) is still live: it waits
    ring.give(ta)
    taker.join(timeout=10)
    assert not taker.is_alive() and got["piece"][1][0] == 0  # wrapped to the freed start
    with pytest.raises(ValueError, match="does not fit"):
        ring.take(11)


def test_a_consumer_thread_sees_every_piece_intact():
    """The producer writes a pattern into each piece; a consumer reads them in order and hands
    them back: no piece is ever handed out while it overlaps one still live."""
    ring = staging.Ring(1000, torch.float32, pin=False)
    rng = random.Random(0)
    queue, seen = [], []
    cond = threading.Condition()

    def consume():
        for _ in range(300):
            with cond:
                cond.wait_for(lambda: queue)
                k, piece, ticket = queue.pop(0)
            seen.append(bool((piece == k).all()))
            ring.give(ticket)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for k in range(300):
        piece, ticket = ring.take(rng.choice([0, 1, 7, 120, 333, 1000]))
        piece.fill_(k)
        with cond:
            queue.append((k, piece, ticket))
            cond.notify()
    consumer.join(timeout=30)
    assert len(seen) == 300 and all(seen)


def test_the_planner_counts_the_same_ring():
    assert plan_memory.STAGING_BYTES is staging.STAGING_BYTES  # imported, not copied


@pytest.mark.parametrize("on_gpu", [0.0, 0.6, 1.0])
def test_a_ring_for_every_offloaded_dtype_wherever_its_sums_are(on_gpu):
    """The rings are sized from the offloaded buckets, not from the host's accumulators: with
    every sum kept on the GPU (``--gpu-accumulation 1``) there are none, and the first upload
    on a GPU once found no size for its dtype (the uncapped OpenVLA-7B layout, offload 0.5)."""
    from parallax.optim import ZeroOptimizer
    from parallax.testing import ParallelContext
    from tests.optim.common import OPTIMIZERS, build, groups

    model = build(dtype=torch.bfloat16)
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = ZeroOptimizer(
        groups(model), cls, ParallelContext.local(), stage=2, modules=[model], bucket_numel=100,
        param_order=model.parameters(), backward_passes_per_step=2, offload=True,
        offload_fraction=0.5, gpu_accumulation=on_gpu, host_adamw="one-pass", **kwargs,
    )  # fmt: skip
    steps, layout = opt.host.steps, opt.flat.layout
    chunks = [layout.buckets[b].chunk for b in steps.buckets]
    assert steps.buckets and set(steps.up.sizes) == {torch.bfloat16}
    assert min(chunks) > 0 and steps.up.sizes[torch.bfloat16] == sum(chunks)
    assert not steps.sums.flats or on_gpu < 1.0  # (1.0: nothing summed on the host)
    assert sum(chunks) < staging.STAGING_BYTES // 2  # (so the ring is bound by the elements)
